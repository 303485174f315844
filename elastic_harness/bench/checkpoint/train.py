"""Ranks 0 and 1 of ``bench checkpoint``: saves of every kind, and training with saves.

Save measurements (per repeat, interleaved, order rotating):

- ``raw_write``: each rank writes its shard's bytes to one file + fsync (+ directory fsync):
  the disk's bandwidth with DCP's durability.
- ``dcp_sync_save``: ``Saver.save(blocking=True)`` (``checkpoint.manager``): DCP write, ``.metadata`` and
  the checksummed manifest (the harness's full commit).
- ``dcp_only_sync_save``: plain ``dcp.save`` to a fresh directory (no manifest).
- ``async_blocking``: how long ``save`` blocks with async on (staging into host memory);
  ``async_total``: until the background write and commit finished.
- ``baseline_save``: the seeds' way: rank 0 ``torch.save`` of the full state + fsync,
  barrier.

Training (``step_*``): a DDP MLP whose model + AdamW state is about ``size``; mean step time
over ``steps`` steps with no saves, with an async save every ``every`` steps (as configured
by default), with a sync save every ``every`` steps, and two *floors* (``checkpoint.floor``):
raw durable writes of this rank's share of a save every ``every`` steps, with ``O_DIRECT``
(``step_floor_direct``) or through the page cache (``step_floor_buffered``). A window is ``steps / every`` whole intervals of a run that saves
every ``every`` steps: each starts with its save (of the state the previous step left) and
gives that save its ``every`` steps to finish in, as every save of a long run has; the
window ends once the last save has committed, so all of its cost is inside. (Saving at the
end of each interval instead left the last save's whole write outside any overlap: one
unoverlapped write per window, which no save of a long run pays.)

Per window, besides its time: the CPU the ranks used, all their threads
(``cpu_<kind>``), and where the whole machine's time went (``machine_<what>_<kind>``, from
/proc/stat, read by rank 0: user, kernel, idle, iowait, steal), each per step.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from elastic_harness.bench.checkpoint.common import (
    Events,
    local_tensors,
    make_saver,
    raw_write,
    sharded,
    timed,
)
from elastic_harness.bench.checkpoint.floor import Floor
from elastic_harness.bench.cpuwindow import machine_times
from elastic_harness.runtime.state import ModelState, OptimState


def save_phase(rank: int, full: dict, mesh2: Any, g2: Any, ckpt_group: Any, root: Path,
               repeats: int, samples: dict) -> None:
    state = sharded(full, mesh2, rank, 2, fill=True)
    sync_m = make_saver(rank, root / "sync", ckpt_group, False, Events())
    async_m = make_saver(rank, root / "async", ckpt_group, True, Events())
    step = iter(range(1, 10**9))
    scratch = root / "scratch"
    (root / "raw").mkdir(exist_ok=True)
    kinds = _save_kinds(rank, full, state, root, g2, Savers(sync_m, async_m, step, ckpt_group))
    kinds["async_blocking"]()  # warm-ups: the first DCP save plans and allocates the staging buffer
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


@dataclass(frozen=True)
class Savers:
    """What the DCP saves go through: the blocking and the async manager, the counter that
    numbers the saves (``step``), and the checkpoint group."""

    sync_m: Any
    async_m: Any
    step: Any
    ckpt_group: Any


def _save_kinds(rank: int, full: dict, state: dict, root: Path, g2: Any, savers: Savers) -> dict:
    """Each save measured, by name (the module doc), as a call."""
    legacy, scratch = root / "legacy.pt", root / "scratch"
    sync_m, async_m, step, ckpt_group = savers.sync_m, savers.async_m, savers.step, savers.ckpt_group

    def baseline() -> None:
        if rank == 0:
            with open(legacy, "wb") as f:
                torch.save(full, f)
                f.flush()
                os.fsync(f.fileno())
        dist.barrier(group=g2)

    def dcp_only() -> None:
        dcp.save(state, checkpoint_id=str(scratch / str(next(step))), process_group=ckpt_group)

    return {
        "raw_write": lambda: raw_write(root / "raw" / f"rank{rank}.bin", local_tensors(state)),
        "dcp_sync_save": lambda: sync_m.save(next(step), state, blocking=True),
        "dcp_only_sync_save": dcp_only,
        "async_blocking": lambda: async_m.save(next(step), state, blocking=False),
        "baseline_save": baseline,
    }


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

    def train_step() -> None:
        optim.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        optim.step()

    managers = {
        "step_async_save": make_saver(rank, root / "train-async", ckpt_group, True, Events()),
        "step_sync_save": make_saver(rank, root / "train-sync", ckpt_group, False, Events()),
    }
    floor = Floor(rank, root / "floor", [p.detach() for p in model.parameters()], world=2)
    runs = {**{k: managers.get(k) for k in ("step_no_save", *managers)},
            "step_floor_direct": floor.saver(direct=True), "step_floor_buffered": floor.saver(direct=False)}
    window = _Windows(rank, cfg, g2, {"model": ModelState(model), "optim": OptimState(model, optim)},
                      train_step, runs, samples)
    for _ in range(2):  # warm-ups: plans, staging buffers, allocator
        window("step_async_save")
    window("step_floor_direct")
    for key in [k for k in samples if k.startswith(("cpu_", "machine_"))]:  # the warm-ups': not measurements
        del samples[key]
    kinds = list(runs)
    for r in range(cfg["windows"]):
        for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
            samples.setdefault(kind, []).append(window(kind))
    for m in managers.values():
        m.close()
    floor.close()


class _Windows:
    """A window of ``cfg["steps"]`` training steps saving every ``cfg["every"]`` the way
    ``runs[kind]`` does (None: no saves), ended once its last save committed: its mean step
    time (the slower rank's), and into ``samples`` the ranks' CPU and the machine's time per step."""

    def __init__(self, rank: int, cfg: dict, g2: Any, state: dict, train_step: Any, runs: dict,
                 samples: dict) -> None:
        self.rank, self.cfg, self.g2, self.state, self.train_step = rank, cfg, g2, state, train_step
        self.runs, self.samples = runs, samples
        self.counter = iter(range(1, 10**9))

    def __call__(self, kind: str) -> float:
        save, steps = self.runs[kind], self.cfg["steps"]
        dist.barrier(group=self.g2)
        t0, cpu0, machine0 = time.perf_counter(), time.process_time(), machine_times()
        for i in range(steps):
            if save is not None and i % self.cfg["every"] == 0:
                save.save(next(self.counter), self.state, blocking=kind == "step_sync_save")
            self.train_step()
        if save is not None:
            save.wait()
        if self.rank == 0:  # machine-wide: one rank's reading covers both
            for what, secs in machine_times().items():
                if what in machine0:
                    self.samples.setdefault(f"machine_{what}_{kind}", []).append((secs - machine0[what]) / steps)
        t = torch.tensor([(time.perf_counter() - t0) / steps], dtype=torch.float64)
        cpu = torch.tensor([(time.process_time() - cpu0) / steps], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.g2)
        dist.all_reduce(cpu, op=dist.ReduceOp.SUM, group=self.g2)
        self.samples.setdefault("cpu_" + kind, []).append(float(cpu.item()))
        return float(t.item())
