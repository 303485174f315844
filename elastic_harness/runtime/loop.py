"""The training loop: a fixed global batch per step, whatever the world size.

Each step takes the next ``global_batch_size`` stream positions; this rank's share is split
into the same number of micro-batches on every rank, and each micro-batch's per-sample
losses are summed and scaled by ``world_size / global_batch_size``. DDP/FSDP average
gradients over ranks, so the update is the mean over exactly the global batch, even when
the shares differ by one sample.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elastic_harness.data.sampler import EpochOrder, micro_batches, split, step_indices
from elastic_harness.runtime.parallel import grad_sync
from elastic_harness.runtime.schedule import lr_at
from elastic_harness.runtime.state import TrainState
from elastic_harness.spec import JobSpec


@dataclass
class Trainer:
    spec: JobSpec
    task: Any
    model: nn.Module
    optim: torch.optim.Optimizer
    dataset: Any
    order: EpochOrder
    device: torch.device
    rank: int
    world_size: int
    collate: Any = None
    sample_log: Path | None = None
    generation: str = ""  # id of this worker generation (same on all ranks)


def step_seed(seed: int, step: int, rank: int) -> int:
    """Per-step, per-rank RNG seed: randomness needs no checkpointing and replays exactly."""
    return ((seed * 1_000_003 + step) * 10_007 + rank) % (2**63 - 1)


def _collate(items: list) -> Any:
    if isinstance(items[0], (tuple, list)):
        return tuple(torch.stack(parts) for parts in zip(*items, strict=True))
    return torch.stack(items)


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, (tuple, list)):
        return type(batch)(b.to(device, non_blocking=True) for b in batch)
    return batch.to(device, non_blocking=True)


def train_step(tr: Trainer, state: TrainState, flags: list[float]) -> tuple[float, list[float]]:
    """One optimizer step. Returns the global mean loss and the all-reduced ``flags``."""
    spec = tr.spec
    G = spec.train.global_batch_size
    torch.manual_seed(step_seed(spec.train.seed, state.step, tr.rank))
    lr = lr_at(state.step, spec.optimizer, spec.train.steps)
    for group in tr.optim.param_groups:
        group["lr"] = lr
    mine = step_indices(tr.order, state.data.cursor, G, tr.world_size, tr.rank)
    chunks = split(mine, micro_batches(G, tr.world_size, spec.train.micro_batch_size))
    tr.optim.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), dtype=torch.float64)
    collate = tr.collate or _collate
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        with grad_sync(tr.model, spec.parallelism, enabled=last):
            batch = _to(collate([tr.dataset[j] for j in chunk]), tr.device)
            per_sample = tr.task.loss(tr.model, batch)
            (per_sample.sum() * (tr.world_size / G)).backward()
        loss_sum += per_sample.detach().double().sum().cpu()
    if spec.optimizer.grad_clip:
        torch.nn.utils.clip_grad_norm_(tr.model.parameters(), spec.optimizer.grad_clip)
    tr.optim.step()
    if tr.sample_log is not None:
        _record(tr, state.step + 1, mine)
    state.step += 1
    state.data = state.data.advance(G)
    totals = torch.tensor([float(loss_sum), *flags], dtype=torch.float64)
    dist.all_reduce(totals)
    return float(totals[0]) / G, totals[1:].tolist()


def _record(tr: Trainer, step: int, indices: list[int]) -> None:
    line = {"t_ns": time.time_ns(), "generation": tr.generation, "step": step, "rank": tr.rank,
            "world_size": tr.world_size, "indices": indices}
    fd = os.open(tr.sample_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(line) + "\n").encode())
    finally:
        os.close(fd)


def save_due_by_steps(spec: JobSpec, step: int) -> bool:
    every = spec.checkpoint.every_steps
    return bool(every) and step % every == 0


def save_due_by_time(spec: JobSpec, seconds_since_save: float) -> bool:
    """Decided on rank 0 only and shared with the step's all-reduce (clocks differ)."""
    every = spec.checkpoint.every_seconds
    return bool(every) and seconds_since_save >= every
