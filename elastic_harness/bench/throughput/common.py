"""What both training scripts of ``bench throughput`` share: arguments, model, step clock.

``throughput.plain`` (plain torchrun DDP) and ``throughput.harness`` (the public API) differ only in
how they start, load data and end a step; everything measured is built here, the same way
for both. The model is an MLP over 3 x 32 x 32 images (``hidden`` wide, two hidden layers)
trained with AdamW: large enough that a step takes tens of milliseconds on one CPU thread,
so per-step overheads are visible but do not dominate.

The clock: rank 0 stamps ``time.perf_counter()`` at the top of every loop iteration, so
consecutive stamps span one whole step (loading, compute, the update, whatever ends the
step), and the process's CPU time (``time.process_time()``, every thread of the rank: the
gloo threads too) beside it: CPU per step is what a busy shared machine distorts least.
``mark(phase)`` stamps the end of a phase of the loop body (``compute``: the micro-batches'
loading, forward and backward; ``optimizer``; ``hook``); the time from the body's last mark
to the next step's top is ``outside`` (the harness's ``run.steps`` generator: its loading). Every rank counts the samples it trained; ``StepClock.finish`` sums them over the
default group (the smoke test checks both sides trained the same) and rank 0 writes the
JSON the bench host reads. Call order: ``tick`` at the top of each step, ``count`` per
micro-batch, ``finish`` once after the loop, while the process group still exists.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from elastic_harness.bench.throughput.data import CLASSES, KINDS, SIDE


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The scripts' arguments; the plain script alone takes the schedule (the harness
    script reads steps and batch sizes from its job)."""
    p = argparse.ArgumentParser(description="bench throughput training script")
    p.add_argument("--data", choices=KINDS, required=True)
    p.add_argument("--data-dir", required=True, help="where data.write_images put the set")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1, help="torch compute threads per rank")
    p.add_argument("--out", required=True, help="rank 0 writes the step stamps here (JSON)")
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--global-batch", type=int, default=0)
    p.add_argument("--micro-batch", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--job", help="harness script under plain torchrun: its job YAML")
    p.add_argument("--save-every", type=int, default=0,
                   help="plain script: torch.save model+optimizer on rank 0 every N steps (0: never)")
    p.add_argument("--save-dir", help="plain script: where --save-every writes ckpt.pt")
    p.add_argument("--hsdp-shard", type=int, default=0,
                   help="FSDP2 on a (world/S replicas x S shards) mesh instead of DDP (0: DDP)")
    return p.parse_args(argv)


def build_model(hidden: int) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(3 * SIDE * SIDE, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, CLASSES),
    )


def build_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


class StepClock:
    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.stamps: list[float] = []
        self.cpu: list[float] = []  # process CPU seconds at each stamp
        self.hook_s: list[float] = []  # the harness's step hook (step.done), when timed
        self.phases: dict[str, list[float]] = {}  # phase -> seconds per step (rank 0)
        self._last = 0.0
        self.samples = 0

    def tick(self) -> None:
        if self.rank == 0:
            now = time.perf_counter()
            if self.stamps:
                self.phases.setdefault("outside", []).append(now - self._last)
            self.stamps.append(now)
            self.cpu.append(time.process_time())
            self._last = now

    def mark(self, phase: str) -> None:
        """The loop body's ``phase`` ended now (rank 0 records it)."""
        if self.rank == 0:
            now = time.perf_counter()
            self.phases.setdefault(phase, []).append(now - self._last)
            self._last = now

    def count(self, n: int) -> None:
        self.samples += n

    def hook(self, seconds: float) -> None:
        self.hook_s.append(seconds)

    def finish(self, out: str | Path, **info: object) -> None:
        """Every rank: sum the samples; rank 0 writes ``out``."""
        total = torch.tensor([self.samples], dtype=torch.int64)
        dist.all_reduce(total)
        if self.rank == 0:
            record = {"stamps": self.stamps, "cpu": self.cpu, "hook_s": self.hook_s,
                      "phases": self.phases, "samples": int(total),
                      "world_size": self.world_size, **info}
            Path(out).write_text(json.dumps(record))
