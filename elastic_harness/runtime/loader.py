"""Load the items the harness chose for each step: in the training process, or ahead of it.

Which samples a step uses is decided by ``data.sampler.step_plan`` (the stream cursor, the
global batch, this rank's share, the micro-batch split); this module only fetches them.
With ``data.workers > 0`` a ``torch.utils.data.DataLoader`` whose batch sampler replays that
plan fetches and collates micro-batches in worker processes, ``data.prefetch`` micro-batches
ahead per worker, pinned when CUDA is present, so loading overlaps compute. Nothing about
the loader is saved: a restart builds a new one from the restored cursor.

A stream (``data.stream.Stream``) is read by ``StreamLoader`` instead: each loader process
(or the training process, with ``data.workers: 0``) reads the lanes ``data.order`` gives it
and yields, per step, the samples of its lanes; the training process puts them in plan order
and collates them. With ``train.record_samples`` both loaders also return each sample's
identity and content hash (``runtime.audit``).

Per-item randomness (augmentation in ``__getitem__``) is seeded from ``(seed, stream
position)`` right before each item is fetched, so it is the same whatever the world size,
the number of loader processes, or where a restart resumed. The training process's own RNG
is seeded per step afterwards (``runtime.session``), so fetching never disturbs it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, default_collate, get_worker_info

from elastic_harness.data.order import StreamOrder, reader_of_lane, stream_step_plan
from elastic_harness.data.read import DataError, LaneReaders
from elastic_harness.data.sampler import EpochOrder, step_plan
from elastic_harness.data.stream import Stream
from elastic_harness.errors import HarnessError
from elastic_harness.runtime.audit import content_hash
from elastic_harness.runtime.seeding import seed_torch

if TYPE_CHECKING:
    from elastic_harness.spec import JobSpec

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


class _Hashed:
    """``collate(items)`` and each item's content hash (``train.record_samples``)."""

    def __init__(self, collate: Callable) -> None:
        self.collate = collate

    def __call__(self, items: list) -> tuple[Any, list[str]]:
        return self.collate(items), [content_hash(x) for x in items]


@dataclass(frozen=True)
class LoaderSettings:
    """What both loaders take besides their data and steps: the job's seed, the device the
    batches go to, the collate function, the loader processes and their prefetch, pinned
    memory, and whether each sample's (index, content hash) is kept (``record``)."""

    seed: int
    device: torch.device
    collate: Callable | None
    workers: int
    prefetch: int
    pin_memory: bool
    record: bool = False

    @classmethod
    def of(cls, spec: JobSpec, device: torch.device, collate: Callable | None) -> LoaderSettings:
        return cls(spec.train.seed, device, collate, spec.data.workers, spec.data.prefetch,
                   spec.data.pin_memory, spec.train.record_samples)


class StepLoader:
    """Per step, this rank's micro-batches (collated, on the device) and the plan behind them.

    ``plan_of(step)`` gives the plan of the step that *starts* after ``step`` updates; the
    loader is built for steps ``first_step .. last_step`` (exclusive) and must be read in
    order, one ``next_step()`` per optimizer step. ``close()`` stops loader processes.
    With ``record``, ``meta`` holds the last step's (index, content hash) per sample.
    """

    def __init__(self, dataset: Any, plan_of: Callable[[int], Plan], first_step: int,
                 last_step: int, settings: LoaderSettings) -> None:
        s = settings
        self.plan_of, self.device, self.record = plan_of, s.device, s.record
        self.collate = _Hashed(s.collate or default_collate) if s.record else (s.collate or default_collate)
        self.items = PositionedItems(dataset, s.seed)
        self.step = first_step
        self.meta: list | None = None
        self.order: Any = None  # the stream's epoch order, set by ``runtime.resume.bind_data``
        self._iter: Iterator | None = None
        self._loader: DataLoader | None = None
        if s.workers > 0 and last_step > first_step:
            self._loader = DataLoader(
                self.items, batch_sampler=PlannedBatches(plan_of, first_step, last_step),
                num_workers=s.workers, collate_fn=self.collate, prefetch_factor=s.prefetch,
                pin_memory=s.pin_memory and s.device.type == "cuda",
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
        if self.record:
            hashes = [h for _, hs in batches for h in hs]
            self.meta = list(zip([i for chunk in plan for _, i in chunk], hashes, strict=True))
            batches = [b for b, _ in batches]
        return plan, [to_device(b, self.device) for b in batches]

    def fetch(self, plan: Plan) -> tuple[list[Any], list | None]:
        """Micro-batches of any ``plan`` (positions of other ranks' shares: the step in flight
        finished without a lost rank, ``runtime.inflight``), read in this process, and with
        ``record`` their (index, content hash); the loader's own order is not touched."""
        batches = [self.collate([self.items[key] for key in chunk]) for chunk in plan]
        meta = None
        if self.record:
            hashes = [h for _, hs in batches for h in hs]
            meta = list(zip([i for chunk in plan for _, i in chunk], hashes, strict=True))
            batches = [b for b, _ in batches]
        return [to_device(b, self.device) for b in batches], meta

    def close(self) -> None:
        """Stop loader processes (safe to call twice)."""
        self._iter = None
        self._loader = None


class _Failure:
    """A ``HarnessError`` raised in a loader process, carried to the training process as data
    (``DataLoader`` would re-raise it wrapped in a traceback text)."""

    def __init__(self, e: HarnessError) -> None:
        self.message, self.hint = e.message, e.hint


def _as_is(x: Any) -> Any:
    return x


class StreamSteps(torch.utils.data.IterableDataset):
    """Per step, the ``(position, sample, (shard, offset), hash)`` of the positions whose lanes
    this process reads (one list per step, empty if it reads none of that step's lanes)."""

    def __init__(self, stream: Stream, order: StreamOrder, plan_of: Callable[[int], Plan],
                 first_step: int, last_step: int, dp_size: int, seed: int, record: bool) -> None:
        self.stream, self.order, self.plan_of = stream, order, plan_of
        self.first, self.last, self.dp_size = first_step, last_step, dp_size
        self.seed, self.record = seed, record

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        me, readers = (info.id, info.num_workers) if info is not None else (0, 1)
        lanes, transform = LaneReaders(self.stream, self.order), self.stream.transform
        n_lanes = self.order.layout.lanes
        for step in range(self.first, self.last):
            out = []
            for chunk in self.plan_of(step):
                for position, _ in chunk:
                    if reader_of_lane(position % n_lanes, self.dp_size, readers) != me:
                        continue
                    try:
                        shard, offset, item = lanes.read(position)
                    except HarnessError as e:
                        yield _Failure(e)
                        return
                    if transform is not None:
                        s = item_seed(self.seed, position)
                        seed_torch(s)
                        random.seed(s)
                        item = transform(item)
                    out.append((position, item, (shard, offset), content_hash(item) if self.record else None))
            yield out


class StreamLoader:
    """``StepLoader``'s contract for a stream: loader processes split this rank's lanes."""

    def __init__(self, stream: Stream, order: StreamOrder, plan_of: Callable[[int], Plan],
                 first_step: int, last_step: int, *, dp_size: int, settings: LoaderSettings) -> None:
        s = settings
        self.plan_of, self.device, self.record = plan_of, s.device, s.record
        self.collate = s.collate or default_collate
        self.pin = s.pin_memory and s.device.type == "cuda"
        self.step, self.meta = first_step, None
        self.parts = max(s.workers, 1)
        items = StreamSteps(stream, order, plan_of, first_step, last_step, dp_size, s.seed, s.record)
        self._loader: DataLoader | None = None
        if s.workers > 0 and last_step > first_step:
            self._loader = DataLoader(items, batch_size=None, num_workers=s.workers,
                                      collate_fn=_as_is, prefetch_factor=s.prefetch)
            self._iter: Iterator | None = iter(self._loader)
        else:
            self._iter = iter(items)

    def next_step(self) -> tuple[Plan, list[Any]]:
        plan = self.plan_of(self.step)
        self.step += 1
        got: dict[int, tuple] = {}
        for _ in range(self.parts):  # one list per loader process, in process order
            part = next(self._iter)
            if isinstance(part, _Failure):
                raise DataError(part.message, part.hint)
            got.update((p, rest) for p, *rest in part)
        batches = [self.collate([got[p][0] for p, _ in chunk]) for chunk in plan]
        if self.pin:
            batches = [_pinned(b) for b in batches]
        if self.record:
            self.meta = [(got[p][1], got[p][2]) for chunk in plan for p, _ in chunk]
        return plan, [to_device(b, self.device) for b in batches]

    def close(self) -> None:
        self._iter = None
        self._loader = None


def _pinned(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory()
    if isinstance(batch, dict):
        return type(batch)((k, _pinned(v)) for k, v in batch.items())
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(_pinned(v) for v in batch)
    return batch


def stream_planner(order: StreamOrder, start_cursor: int, start_step: int, global_batch: int,
                   dp_size: int, dp_rank: int, micro_batch: int) -> Callable[[int], Plan]:
    """``planner`` for a stream (``data.order.stream_step_plan``), remembering the last few
    steps' plans (the loader and the training process ask for the same step in turn)."""
    recent: dict[int, Plan] = {}

    def plan_of(step: int) -> Plan:
        plan = recent.get(step)
        if plan is None:
            cursor = start_cursor + (step - start_step) * global_batch
            plan = stream_step_plan(order, cursor, global_batch, dp_size, dp_rank, micro_batch)
            if len(recent) >= 8:
                recent.pop(min(recent))
            recent[step] = plan
        return plan

    return plan_of


def planner(order: EpochOrder, start_cursor: int, start_step: int, global_batch: int,
            dp_size: int, dp_rank: int, micro_batch: int) -> Callable[[int], Plan]:
    """``plan_of(step)``: the cursor advances by exactly ``global_batch`` per step; this
    data-parallel rank's share of it (``dp_rank`` of ``dp_size``: ``runtime.topology``)."""

    def plan_of(step: int) -> Plan:
        cursor = start_cursor + (step - start_step) * global_batch
        return step_plan(order, cursor, global_batch, dp_size, dp_rank, micro_batch)

    return plan_of
