"""Ranks 0 and 1 of ``bench checkpoint``: saves of every kind, and training with saves.

Save measurements (per repeat, interleaved, order rotating):

- ``raw_write``: each rank writes its shard's bytes to one file + fsync (+ directory fsync):
  the disk's bandwidth with DCP's durability.
- ``dcp_sync_save``: ``CheckpointManager.save(blocking=True)``: DCP write, ``.metadata`` and
  the checksummed manifest (the harness's full commit).
- ``dcp_only_sync_save``: plain ``dcp.save`` to a fresh directory (no manifest).
- ``async_blocking``: how long ``save`` blocks with async on (staging into host memory);
  ``async_total``: until the background write and commit finished.
- ``baseline_save``: the seeds' way: rank 0 ``torch.save`` of the full state + fsync,
  barrier.

Training (``step_*``): a DDP MLP whose model + AdamW state is about ``size``; mean step time
over ``steps`` steps with no saves, with an async save every ``every`` steps, and with a sync
save every ``every`` steps. A window is ``steps / every`` whole intervals of a run that saves
every ``every`` steps: each starts with its save (of the state the previous step left) and
gives that save its ``every`` steps to finish in, as every save of a long run has; the
window ends once the last save has committed, so all of its cost is inside. (Saving at the
end of each interval instead left the last save's whole write outside any overlap: one
unoverlapped write per window, which no save of a long run pays.)
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from elastic_harness.bench.ckpt_common import (
    Events,
    local_tensors,
    make_manager,
    raw_write,
    sharded,
    timed,
)
from elastic_harness.runtime.state import ModelState, OptimState


def save_phase(rank: int, full: dict, mesh2: Any, g2: Any, ckpt_group: Any, root: Path,
               repeats: int, samples: dict) -> None:
    state = sharded(full, mesh2, rank, 2, fill=True)
    sync_ev, async_ev = Events(), Events()
    sync_m = make_manager(rank, root / "sync", ckpt_group, False, sync_ev)
    async_m = make_manager(rank, root / "async", ckpt_group, True, async_ev)
    step = iter(range(1, 10**9))
    legacy, scratch = root / "legacy.pt", root / "scratch"
    (root / "raw").mkdir(exist_ok=True)

    def baseline() -> None:
        if rank == 0:
            with open(legacy, "wb") as f:
                torch.save(full, f)
                f.flush()
                os.fsync(f.fileno())
        dist.barrier(group=g2)

    def dcp_only() -> None:
        dcp.save(state, checkpoint_id=str(scratch / str(next(step))), process_group=ckpt_group)

    def async_save() -> None:
        async_m.save(next(step), state, blocking=False)

    kinds = {
        "raw_write": lambda: raw_write(root / "raw" / f"rank{rank}.bin", local_tensors(state)),
        "dcp_sync_save": lambda: sync_m.save(next(step), state, blocking=True),
        "dcp_only_sync_save": dcp_only,
        "async_blocking": async_save,
        "baseline_save": baseline,
    }
    async_save()  # warm-ups: the first DCP save plans and allocates the staging buffer
    async_m.wait()
    sync_m.save(next(step), state, blocking=True)
    names = list(kinds)
    for r in range(repeats):
        for kind in names[r % len(names):] + names[:r % len(names)]:
            samples.setdefault(kind, []).append(timed(kinds[kind], g2))
            if kind == "async_blocking":
                samples.setdefault("async_total", []).append(timed(async_m.wait, g2) + samples[kind][-1])
            if rank == 0 and kind == "dcp_only_sync_save":
                shutil.rmtree(scratch, ignore_errors=True)
            dist.barrier(group=g2)
    dcp.save(state, checkpoint_id=str(root / "load-src"), process_group=ckpt_group)
    async_m.close()
    sync_m.close()


def _model(size: int) -> nn.Module:
    """Four square layers; parameters + AdamW's two moments take about ``size`` bytes."""
    width = max(16, int((size / (3 * 4 * 4)) ** 0.5))
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(4)])


def train_phase(rank: int, cfg: dict, g2: Any, ckpt_group: Any, root: Path, samples: dict) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_model(cfg["size"]), process_group=g2)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    width = model.module[0].in_features
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, width, generator=gen), torch.randn(32, width, generator=gen)
    state = {"model": ModelState(model), "optim": OptimState(model, optim)}
    managers = {
        "step_async_save": make_manager(rank, root / "train-async", ckpt_group, True, Events()),
        "step_sync_save": make_manager(rank, root / "train-sync", ckpt_group, False, Events()),
    }
    counter = iter(range(1, 10**9))

    def window(kind: str) -> float:
        mgr = managers.get(kind)
        dist.barrier(group=g2)
        t0 = time.perf_counter()
        for i in range(cfg["steps"]):
            if mgr is not None and i % cfg["every"] == 0:
                mgr.save(next(counter), state, blocking=kind == "step_sync_save")
            optim.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
            optim.step()
        if mgr is not None:
            mgr.wait()
        t = torch.tensor([(time.perf_counter() - t0) / cfg["steps"]], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g2)
        return float(t.item())

    window("step_async_save")  # warm-up: plans, staging buffer, allocator
    kinds = ["step_no_save", "step_async_save", "step_sync_save"]
    for r in range(cfg["repeats"]):
        for kind in kinds[r % 3:] + kinds[:r % 3]:
            samples.setdefault(kind, []).append(window(kind))
    for m in managers.values():
        m.close()
