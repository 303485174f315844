"""CheckpointManager on two real gloo ranks: fallback, agreement, retention, async + DTensor.

One ``torch.multiprocessing`` spawn runs every scenario (each in its own directory); the
ranks write what they saw to JSON and the assertions run here.
"""

from __future__ import annotations

import datetime as dt
import json
import socket
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(180)


class Events:
    def __init__(self) -> None:
        self.seen: list[dict] = []

    def emit(self, event: str, **fields) -> dict:
        self.seen.append({"event": event, **fields})
        return fields


def _manager(rank: int, root: Path, group, **policy):
    from elastic_harness.checkpoint.manager import CheckpointManager
    from elastic_harness.checkpoint.storage import LocalStorage
    from elastic_harness.spec import CheckpointSpec

    events = Events()
    storage = LocalStorage(root)
    storage.ensure()
    return CheckpointManager(storage, CheckpointSpec(**policy), rank=rank, world_size=2, group=group,
                             events=events, info={"task": "t"}), events


def _state(value: float, mesh=None) -> dict:
    model = {f"w{i}": torch.full((256, 64), value) for i in range(4)}
    if mesh is not None:
        from torch.distributed.tensor import DTensor, Shard

        model["sharded"] = DTensor.from_local(torch.full((5, 8), value), mesh, [Shard(0)], run_check=False)
    return {"model": model, "train": {"step": torch.tensor(int(value))}}


def _biggest_shard(step_dir: Path) -> Path:
    return max(step_dir.glob("*.distcp"), key=lambda p: p.stat().st_size)


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 4] = bytes(b ^ 0xFF for b in data[mid:mid + 4])
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _restore(rank, root, group, **policy) -> dict:
    import torch.distributed as dist

    from elastic_harness.errors import CheckpointError

    mgr, events = _manager(rank, root, group, **policy)
    st = _state(0.0)
    try:
        loaded = mgr.restore(st)
        out = {"step": loaded.step if loaded else None, "value": float(st["model"]["w0"][0, 0])}
    except CheckpointError as e:
        out = {"error": str(e)}
    dist.barrier()
    mgr.close()
    return {**out, "warnings": [e["message"] for e in events.seen if e["event"] == "warning"]}


def _save_steps(rank, root, group, steps, **policy) -> None:
    mgr, _ = _manager(rank, root, group, **policy)
    for s in steps:
        assert mgr.save(s, _state(float(s)), blocking=True)
    mgr.close()


def scenario_verify_fallback(rank, root, group) -> dict:
    """Newest: flipped bytes; next: truncated .metadata; next: .metadata deleted."""
    import torch.distributed as dist

    _save_steps(rank, root, group, [1, 2, 3, 4], keep=5, async_save=False)
    if rank == 0:
        _flip(_biggest_shard(root / "step-0000004"))
        _truncate(root / "step-0000003" / ".metadata")
        (root / "step-0000002" / ".metadata").unlink()
    dist.barrier()
    return _restore(rank, root, group, keep=5)


def scenario_load_failure_fallback(rank, root, group) -> dict:
    """verify=none: corruption is only found by loading, which must fall back too."""
    import torch.distributed as dist

    _save_steps(rank, root, group, [1, 2, 3], keep=5, async_save=False)
    if rank == 0:
        _truncate(root / "step-0000003" / ".metadata")
        _truncate(_biggest_shard(root / "step-0000002"))
    dist.barrier()
    return _restore(rank, root, group, keep=5, verify="none")


def scenario_nothing_usable(rank, root, group) -> dict:
    import torch.distributed as dist

    _save_steps(rank, root, group, [1], async_save=False)
    if rank == 0:
        _flip(_biggest_shard(root / "step-0000001"))
    dist.barrier()
    return _restore(rank, root, group)


def scenario_async_retention(rank, root, group) -> dict:
    """Async saves with a DTensor; keep newest 2 plus every 3rd; a crashed save's leftovers go."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", torch.arange(2))
    if rank == 0:
        (root / "step-0000000").mkdir(parents=True)
        (root / "step-0000000" / "__0_0.distcp").write_bytes(b"partial")
    dist.barrier()
    mgr, events = _manager(rank, root, group, keep=2, keep_every=3, async_save=True)
    started = [mgr.save(s, _state(float(s), mesh), blocking=False) for s in range(1, 8)]
    mgr.wait()
    again = mgr.save(7, _state(7.0, mesh), blocking=False)
    mgr.close()
    st = _state(0.0, mesh)
    loaded, _ = _manager(rank, root, group)
    step = loaded.restore(st).step
    loaded.close()
    dist.barrier()
    return {"started": started, "again": again, "step": step, "dirs": sorted(p.name for p in root.iterdir()),
            "sharded": st["model"]["sharded"].to_local().unique().tolist(),
            "checkpoints": [(e["step"], e["asynchronous"]) for e in events.seen if e["event"] == "checkpoint"]}


SCENARIOS = [scenario_verify_fallback, scenario_load_failure_fallback, scenario_nothing_usable,
             scenario_async_retention]


def _ranks(rank: int, port: int, root: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=dt.timedelta(seconds=60))
    group = dist.new_group(backend="gloo")
    out = {}
    try:
        for fn in SCENARIOS:
            out[fn.__name__] = fn(rank, Path(root) / fn.__name__, group)
    finally:
        dist.destroy_process_group()
    Path(root, f"rank{rank}.json").write_text(json.dumps(out))


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> list[dict]:
    import torch.multiprocessing as mp

    root = tmp_path_factory.mktemp("manager")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ranks, args=(port, str(root)), nprocs=2, join=True)
    return [json.loads((root / f"rank{r}.json").read_text()) for r in range(2)]


def test_corrupt_newer_checkpoints_fall_back_and_ranks_agree(seen):
    a, b = (r["scenario_verify_fallback"] for r in seen)
    assert a["step"] == b["step"] == 1 and a["value"] == b["value"] == 1.0
    warnings = "\n".join(a["warnings"])
    assert "skipping step-0000004: __" in warnings and "checksum mismatch" in warnings
    assert "skipping step-0000003: .metadata has" in warnings
    assert "ignoring incomplete checkpoint step-0000002" in warnings


def test_unverified_corruption_is_caught_by_loading(seen):
    a, b = (r["scenario_load_failure_fallback"] for r in seen)
    assert a["step"] == b["step"] == 1 and a["value"] == b["value"] == 1.0
    assert any(w.startswith("loading step-0000003 failed") for w in a["warnings"])
    assert any(w.startswith("loading step-0000002 failed") for w in a["warnings"])


def test_no_usable_checkpoint_is_an_error_not_a_silent_fresh_start(seen):
    for r in seen:
        assert "none of the 1 checkpoints" in r["scenario_nothing_usable"]["error"]
        assert "--fresh" in r["scenario_nothing_usable"]["error"]


def test_async_saves_retention_and_dtensor_round_trip(seen):
    a, b = (r["scenario_async_retention"] for r in seen)
    assert a["started"] == [True] * 7 and a["again"] is False  # step 7 exists: nothing written
    assert a["checkpoints"] == [[s, True] for s in range(1, 8)]
    assert a["dirs"] == ["step-0000003", "step-0000006", "step-0000007"]  # leftover step-0 gone too
    assert a["step"] == b["step"] == 7 and a["sharded"] == b["sharded"] == [7.0]
