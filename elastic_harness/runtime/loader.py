"""Load the items the harness chose for each step: in the training process, or ahead of it.

Which samples a step uses is decided by ``data.sampler.step_plan`` (the stream cursor, the
global batch, this rank's share, the micro-batch split); this module only fetches them.
With ``data.workers > 0`` a ``torch.utils.data.DataLoader`` whose batch sampler replays that
plan fetches and collates micro-batches in worker processes, ``data.prefetch`` micro-batches
ahead per worker, pinned when CUDA is present, so loading overlaps compute. Nothing about
the loader is saved: a restart builds a new one from the restored cursor.

Per-item randomness (augmentation in ``__getitem__``) is seeded from ``(seed, stream
position)`` right before each item is fetched, so it is the same whatever the world size,
the number of loader processes, or where a restart resumed. The training process's own RNG
is seeded per step afterwards (``runtime.session``), so fetching never disturbs it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, default_collate

from elastic_harness.data.sampler import EpochOrder, step_plan
from elastic_harness.runtime.seeding import seed_torch

Plan = list[list[tuple[int, int]]]  # micro-batches of (stream position, dataset index)


def item_seed(seed: int, position: int) -> int:
    """Seed for the item at a stream position (same on any rank, process or restart)."""
    return ((seed * 0x9E3779B1) ^ (position * 0x85EBCA77 + 0x2545F491)) % (2**63 - 1)


class PositionedItems(torch.utils.data.Dataset):
    """``dataset[(position, index)]``: seed per-item randomness, then fetch ``dataset[index]``."""

    def __init__(self, dataset: Any, seed: int) -> None:
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        position, index = key
        s = item_seed(self.seed, position)
        seed_torch(s)  # torch.manual_seed's effect, without its cost per item (runtime.seeding)
        random.seed(s)
        return self.dataset[index]


class PlannedBatches(torch.utils.data.Sampler):
    """Batch sampler: the micro-batches of steps ``first_step+1 .. last_step``, in order."""

    def __init__(self, plan_of: Callable[[int], Plan], first_step: int, last_step: int) -> None:
        self.plan_of, self.first, self.last = plan_of, first_step, last_step

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        for step in range(self.first, self.last):
            yield from self.plan_of(step)

    def __len__(self) -> int:
        return sum(len(self.plan_of(s)) for s in range(self.first, self.last))


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return type(batch)((k, to_device(v, device)) for k, v in batch.items())
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


class StepLoader:
    """Per step, this rank's micro-batches (collated, on the device) and the plan behind them.

    ``plan_of(step)`` gives the plan of the step that *starts* after ``step`` updates; the
    loader is built for steps ``first_step .. last_step`` (exclusive) and must be read in
    order, one ``next_step()`` per optimizer step. ``close()`` stops loader processes.
    """

    def __init__(self, dataset: Any, plan_of: Callable[[int], Plan], first_step: int,
                 last_step: int, *, seed: int, device: torch.device, collate: Callable | None,
                 workers: int, prefetch: int, pin_memory: bool) -> None:
        self.plan_of, self.device = plan_of, device
        self.collate = collate or default_collate
        self.items = PositionedItems(dataset, seed)
        self.step = first_step
        self._iter: Iterator | None = None
        self._loader: DataLoader | None = None
        if workers > 0 and last_step > first_step:
            self._loader = DataLoader(
                self.items, batch_sampler=PlannedBatches(plan_of, first_step, last_step),
                num_workers=workers, collate_fn=self.collate, prefetch_factor=prefetch,
                pin_memory=pin_memory and device.type == "cuda",
            )
            self._iter = iter(self._loader)

    def next_step(self) -> tuple[Plan, list[Any]]:
        """The plan of the next step and its micro-batches, in order."""
        plan = self.plan_of(self.step)
        self.step += 1
        if self._iter is not None:
            batches = [next(self._iter) for _ in plan]
        else:
            batches = [self.collate([self.items[key] for key in chunk]) for chunk in plan]
        return plan, [to_device(b, self.device) for b in batches]

    def close(self) -> None:
        """Stop loader processes (safe to call twice)."""
        self._iter = None
        self._loader = None


def planner(order: EpochOrder, start_cursor: int, start_step: int, global_batch: int,
            world_size: int, rank: int, micro_batch: int) -> Callable[[int], Plan]:
    """``plan_of(step)``: the cursor advances by exactly ``global_batch`` per step."""

    def plan_of(step: int) -> Plan:
        cursor = start_cursor + (step - start_step) * global_batch
        return step_plan(order, cursor, global_batch, world_size, rank, micro_batch)

    return plan_of
