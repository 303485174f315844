"""The model's and optimizer's checkpoint names, kept from torch's answer (``runtime.statenames``):
what ``ModelState``/``OptimState.state_dict()`` give is torch's ``get_*_state_dict`` answer,
on plain, compiled, DDP and FSDP2 models, before and after the names are kept; values that
change between saves (the learning rate, the tensors) are always the current ones; a
structure torch names otherwise, or one that changed, goes to torch again."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from tests.servers import spawn_ranks

pytestmark = pytest.mark.timeout(120)


def _step(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 8)).square().mean().backward()
    optim.step()
    optim.zero_grad()


def _agree(model: nn.Module, optim: torch.optim.Optimizer, forward: nn.Module | None = None) -> dict:
    """Each state dict twice (the second from kept names), each against torch's answer; the
    steps between run ``forward`` (default: the model itself)."""
    from elastic_harness.runtime import statenames
    from elastic_harness.runtime.state import ModelState, OptimState

    ms, os_ = ModelState(model), OptimState(model, optim)
    out = {}
    for call in ("first", "kept"):
        _step(forward or model, optim)
        out[call] = [statenames.same_data(ms.state_dict(), get_model_state_dict(model)),
                     statenames.same_data(os_.state_dict(), get_optimizer_state_dict(model, optim))]
    out["names_kept"] = [ms._names[1] is not None, os_._names[1] is not None]
    for group in optim.param_groups:  # a scheduler's change between saves is seen
        group["lr"] = 0.125
    out["lr"] = [g["lr"] for g in os_.state_dict()["param_groups"]]
    return out


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.BatchNorm1d(16), nn.Linear(16, 1))


def test_plain_and_compiled_models_get_torchs_names_then_keep_them(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # not /tmp
    torch.manual_seed(0)
    plain = _mlp()
    compiled = torch.compile(_mlp(), backend="eager")  # keys gain _orig_mod. in state_dict()
    for model, forward in ((plain, plain), (compiled, compiled._orig_mod)):  # (no tracing: names only)
        seen = _agree(model, torch.optim.AdamW(model.parameters(), lr=0.01), forward)
        assert seen["first"] == seen["kept"] == [True, True]
        assert seen["names_kept"] == [True, True]
        assert seen["lr"] == [0.125]


def test_a_structure_torch_names_otherwise_keeps_asking_torch():
    """A child named ``module`` in a model no wrapper made: torch keeps the segment, the
    wrappers' renaming would drop it; nothing is kept and every answer is torch's."""
    from elastic_harness.runtime import statenames
    from elastic_harness.runtime.state import ModelState

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(3, 3)

    model = Holder()
    ms = ModelState(model)
    for _ in range(2):
        assert list(ms.state_dict()) == ["module.weight", "module.bias"]
    assert ms._names is not None and ms._names[1] is None
    assert statenames.same_data(ms.state_dict(), get_model_state_dict(model))


def test_a_changed_structure_is_named_by_torch_again():
    from elastic_harness.runtime import statenames
    from elastic_harness.runtime.state import ModelState, OptimState

    model = _mlp()
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    ms, os_ = ModelState(model), OptimState(model, optim)
    _step(model, optim)
    ms.state_dict(), os_.state_dict()
    model.add_module("head", nn.Linear(1, 2))  # a new submodule, and its parameters in a new group
    optim.add_param_group({"params": list(model.head.parameters()), "lr": 0.5})
    model.head(torch.randn(2, 1)).sum().backward()
    optim.step()
    assert "head.weight" in ms.state_dict()
    assert statenames.same_data(ms.state_dict(), get_model_state_dict(model))
    osd = os_.state_dict()
    assert osd["param_groups"][1]["params"] == ["head.weight", "head.bias"]
    assert statenames.same_data(osd, get_optimizer_state_dict(model, optim))


def test_an_optimizer_without_state_goes_to_torch_which_makes_it():
    from elastic_harness.runtime.state import OptimState

    model = _mlp()
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    osd = OptimState(model, optim).state_dict()
    assert set(osd["state"]) == {n for n, _ in model.named_parameters()}  # torch's zero step made it


def _ranks(rank: int, port: int, root: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=dt.timedelta(seconds=60))
    torch.manual_seed(0)
    ddp = DDP(_mlp())
    sharded = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    for layer in (sharded[0], sharded[2]):
        fully_shard(layer, mesh=init_device_mesh("cpu", (2,)))
    fully_shard(sharded, mesh=init_device_mesh("cpu", (2,)))
    out = {name: _agree(model, torch.optim.AdamW(model.parameters(), lr=0.01))
           for name, model in (("ddp", ddp), ("fsdp2", sharded))}
    dist.destroy_process_group()
    Path(root, f"rank{rank}.json").write_text(json.dumps(out))


def test_ddp_and_fsdp2_models_get_torchs_names_then_keep_them(tmp_path):
    for r in spawn_ranks(_ranks, tmp_path):
        for layout in ("ddp", "fsdp2"):
            seen = r[layout]
            assert seen["first"] == seen["kept"] == [True, True], layout
            assert seen["names_kept"] == [True, True], layout
            assert seen["lr"] == [0.125], layout
