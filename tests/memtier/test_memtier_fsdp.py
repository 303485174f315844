"""The in-memory tier's capture of FSDP2 state, on two real gloo ranks.

``snapshot.capture`` reads DTensor parameters and optimizer states without autograd ops
(``no_grad``, ``keep_vars``); what it captures must stay exactly what the plain path captured
(the detached state dicts torch builds), and a restore must bring every byte back.
"""

from __future__ import annotations

import datetime as dt
import io
import json
from pathlib import Path

import pytest
import torch

from tests.servers import spawn_ranks

pytestmark = pytest.mark.timeout(120)


def _reference(state: dict):
    """A capture from the state dicts as torch builds them by default (detached tensors,
    autograd on): the path before the FSDP2 shortcuts."""
    from elastic_harness.memtier import snapshot
    from elastic_harness.runtime.state import ModelState

    trees = {k: v.model.state_dict() if isinstance(v, ModelState) else snapshot._state_dict(v, "local_state_dict")
             for k, v in state.items()}
    assert torch.is_grad_enabled()
    found, parts = snapshot._Found(), {}
    for key, tree in trees.items():
        buf = io.BytesIO()
        snapshot._Pickler(buf, found).dump(tree)
        parts[key] = buf.getvalue()
    return snapshot.Capture(snapshot.pack(parts), parts, found.tensors, found.cursor,
                            snapshot._digest(tuple(found.layout)), found.sources, found.cpu, found.sharded)


def _bytes(cap, views) -> torch.Tensor:
    from elastic_harness.memtier import snapshot

    data = torch.zeros(cap.data_len + len(cap.skeleton), dtype=torch.uint8)
    snapshot.write(cap, data, 0, views)
    return data


def _ranks(rank: int, port: int, root: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from elastic_harness.data.sampler import DataState
    from elastic_harness.memtier import snapshot
    from elastic_harness.runtime.state import TrainState, build_state
    from elastic_harness.tasks.mlp import MLPRegression

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=dt.timedelta(seconds=60))
    out: dict = {"same": []}
    try:
        torch.manual_seed(0)
        model = MLPRegression(samples=64, dim=5, hidden=7, depth=2).build_model()  # odd sizes: uneven shards
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        optim = torch.optim.AdamW(model.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1 + s))
        train = TrainState(DataState(0, 64), world_size=2)
        state = build_state(model, optim, train, scheduler=sched)
        views, ref_views = snapshot.Views(), snapshot.Views()
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))

        def step() -> None:
            model(x).sum().backward()
            optim.step()
            optim.zero_grad()
            sched.step()
            train.step += 1

        for _ in range(3):
            step()
            cap, ref = snapshot.capture(state), _reference(state)
            out["same"].append([cap.skeleton == ref.skeleton, cap.digest == ref.digest, cap.sharded, ref.sharded,
                                bool(torch.equal(_bytes(cap, views), _bytes(ref, ref_views)))])
        data = _bytes(cap, views)
        skeleton = snapshot.read_skeleton(data, 0, cap.data_len, len(cap.skeleton))
        before = [t.clone() for t in _leaves(state)]
        lr = optim.param_groups[0]["lr"]
        step()
        step()
        with torch.no_grad():
            snapshot.restore_into(state, snapshot.targets(state), skeleton, data, 0)
        after = _leaves(state)
        out["restored"] = len(before) == len(after) and all(
            a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(before, after, strict=True))
        out["lr"] = optim.param_groups[0]["lr"] == lr and train.step == 3
        out["leaves"] = len(before)
    finally:
        dist.destroy_process_group()
    Path(root, f"rank{rank}.json").write_text(json.dumps(out))


def _leaves(state: dict) -> list[torch.Tensor]:
    """Every tensor a restore must bring back: parameter shards and optimizer states (steps too)."""
    model, optim = state["model"].model, state["optim"].optim
    out = [p.to_local().detach() for p in model.parameters()]
    for p in model.parameters():
        out += [v.to_local() if hasattr(v, "to_local") else v for _, v in sorted(optim.state[p].items())]
    return out


@pytest.mark.e2e  # two forked ranks under FSDP2: a few seconds
def test_fsdp2_capture_equals_the_plain_capture_and_restores_every_byte(tmp_path):
    for got in spawn_ranks(_ranks, tmp_path):
        assert got["same"] == [[True, True, True, True, True]] * 3
        assert got["restored"] and got["lr"]
        assert got["leaves"] == 6 * 4  # 3 linears x (weight, bias), each with 3 AdamW states besides itself
