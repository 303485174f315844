"""The step hook: what ``Step.done()`` sets off, every rank, after each optimizer step.

One ``StepHook`` per ``Run.steps`` call, built from what it needs (the run hands over its
parts: nothing here reaches back into the ``Run``). In order, for each step:

1. the step's time goes to the snapshot cadence (``memtier.cadence``; the snapshot itself
   is not part of it);
2. persistent buffers are set to rank 0's copy (``runtime.buffers``);
3. the counters advance (step, data cursor) and the step's one all-reduce is collected:
   [loss sum, drain requested, time-based save due, snapshot interval, buddy copies busy (moving
   or held back), stop requested, buddy copies moving]. ``share_totals``
   starts it without waiting when ``step.batches()`` ends (``runtime.step``), so it
   completes while the optimizer steps;
4. metrics (every ``train.log_every`` and at the last step);
5. a durable save if one is due (periodic, by time, the final one, a drain), preceded by the
   cross-rank comparison of an unwrapped model (``ReplicaCheck``), then the in-memory
   snapshot if due. A drain only for a node joining (no rank asked to stop) takes a forced
   in-memory snapshot instead of the storage save where memory covers the next restore
   (``_join_snapshot``; docs/lifecycle.md);
6. a drain ends the step here (``step.drained``: ``Run.steps`` exits 143); otherwise the
   job's scheduled faults for this step fire (``runtime.faults``).

``finish`` is the end of the last step: the final comparison, the model digest, ``finish``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elastic_harness.checkpoint import collective
from elastic_harness.checkpoint.manager import CheckpointManager
from elastic_harness.memtier.cadence import Cadence
from elastic_harness.memtier.tier import MemoryTier
from elastic_harness.runtime.buffers import BufferSync
from elastic_harness.runtime.digest import model_digest
from elastic_harness.runtime.faults import WorkerFaults
from elastic_harness.runtime.metrics import Metrics
from elastic_harness.runtime.registration import replicas_differ, unwrapped_error
from elastic_harness.runtime.state import TrainState
from elastic_harness.runtime.step import Step
from elastic_harness.runtime.timer import ProgressWatchdog
from elastic_harness.runtime.topology import Topology
from elastic_harness.spec import JobSpec


def save_due_by_steps(every: int, step: int) -> bool:
    return bool(every) and step % every == 0


def save_due_by_time(every_s: float, seconds_since_save: float) -> bool:
    """Decided on rank 0 only and shared with the step's all-reduce (clocks differ)."""
    return bool(every_s) and seconds_since_save >= every_s


class ReplicaCheck:
    """An unwrapped model on several data-parallel ranks (``registration``): compared across
    ranks once, before the first save (or the final digest). Every rank calls ``check``;
    ``world_size``: the processes of ``group``, all of which take part."""

    def __init__(self, model: nn.Module, group: Any, world_size: int) -> None:
        self.model, self.group, self.world_size = model, group, world_size
        self.pending = True

    def check(self, step: int) -> None:
        self.pending = False
        differ = replicas_differ(self.model, lambda d: collective.all_gather(d, self.group, self.world_size))
        if differ:
            raise unwrapped_error(self.model, step, differ)


class StepHook:
    """What ``Step`` calls (``runtime.step.Owner``): ``share_totals`` when its micro-batches
    end, ``after_step`` from ``done``. Also what a step reads of its run (``spec``,
    ``dp_size``, ``model``, ``optimizer``, ``scaler``).

    ``topology`` (``runtime.topology``) says who this process is: ``rank`` and
    ``world_size`` are processes (the events' fields), ``dp_size`` the data-parallel degree
    the loss is scaled by."""

    def __init__(self, spec: JobSpec, train: TrainState, state: dict[str, Any], *,
                 model: nn.Module | None, optimizer: torch.optim.Optimizer | None, scaler: Any,
                 topology: Topology, restart: int, events: Any, metrics: Metrics,
                 ckpt: CheckpointManager, memory: MemoryTier | None, cadence: Cadence,
                 drain_requested: Callable[[], bool], watchdog: ProgressWatchdog, faults: WorkerFaults,
                 replicas: ReplicaCheck | None = None, buffers: BufferSync | None = None,
                 sample_log: Path | None = None, stop_requested: Callable[[], bool] | None = None,
                 join_in_memory: bool = False) -> None:
        self.spec, self.train, self.state = spec, train, state
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.rank, self.world_size, self.dp_size = topology.rank, topology.world_size, topology.dp_degree
        # the ranks of a tensor group each count the same samples' loss: the reported mean
        # divides them out
        self.ranks_per_share = topology.ranks_per_share
        self.restart = restart
        self.events, self.metrics, self.ckpt = events, metrics, ckpt
        self.memory, self.cadence = memory, cadence
        self.drain_requested = drain_requested
        # A drain is a stop (storage save) unless every rank's request was a join's only.
        self.stop_requested = stop_requested or drain_requested
        self.join_in_memory = join_in_memory  # ``resume.memory_covers_join``
        self.watchdog, self.faults = watchdog, faults
        self.replicas, self.buffers = replicas, buffers
        self.sample_log = sample_log  # samples/rank-R.jsonl when train.record_samples
        now = time.monotonic()
        self.last_save = self.last_done = self.period_start = now
        self.snapshot_s = 0.0  # the last hook's in-memory snapshot (not part of a step's time)
        self.copy_every: int | None = None  # buddy copies' interval last reported (rank 0)
        self.last_saved_step = -1
        self.last_loss: float | None = None

    # ----- what Step calls -----------------------------------------------------------------
    def share_totals(self, step: Step) -> None:
        """Start the step's one all-reduce, [loss sum, drain requested, time-based save due,
        in-memory snapshot interval] (rank 0 decides the last two: clocks and timings differ),
        without waiting for it (``Step.batches``).

        Waiting for it in the step hook made every step meet its peers twice (the gradient
        all-reduce, then this): whatever the ranks drifted apart during the optimizer step
        was paid again as a wait (``bench throughput``). Started right after the last
        backward, it is done by the time ``done`` needs it. Every rank starts it at the
        same point of the same step, so collectives keep their order.
        """
        if step.shared is not None:
            return
        flag = float(self.rank == 0 and save_due_by_time(self.spec.checkpoint.every_seconds,
                                                         time.monotonic() - self.last_save))
        k = float(self.cadence.proposal(step.number) if self.rank == 0 and self.memory is not None else 0)
        # Buddy copies moving, or (rank 0) not due yet within the tier's budget (``buddy.due``).
        busy = float(self.memory is not None and (
            self.memory.busy(step.number, self.cadence.medians()[1], self.spec.checkpoint.memory_budget)
            if self.rank == 0 else self.memory.busy()))
        # Copies moving (not merely held): none anywhere means the last one is complete on every
        # rank, and the own snapshots it needs may move on (``MemoryTier.save``'s ``settled``).
        moving = float(self.memory is not None and self.memory.moving())
        totals = torch.tensor([float(step.loss_sum), float(self.drain_requested()), flag, k, busy,
                               float(self.stop_requested()), moving], dtype=torch.float64)
        work = dist.all_reduce(totals, async_op=True)
        step.shared = (totals, work, step.loss_sum.clone(), step.samples)

    def after_step(self, step: Step, user_metrics: dict[str, float]) -> None:
        """The step hook's work (``Step.done``): counters, metrics, save, drain, faults."""
        spec, train = self.spec, self.train
        # The whole step, hook included, less the snapshot (``memtier.cadence``'s budget).
        now = time.monotonic()
        self.cadence.step_took(now - self.period_start - self.snapshot_s)
        self.period_start, self.snapshot_s = now, 0.0
        if self.buffers is not None:
            self.buffers.sync()
        train.step += 1
        train.data = train.data.advance(spec.train.global_batch_size)
        totals = self._collect_totals(step)
        now = time.monotonic()
        loss = float(totals[0]) / (spec.train.global_batch_size * self.ranks_per_share)
        self.last_loss = loss
        final = train.step == spec.train.steps
        if train.step % spec.train.log_every == 0 or final:
            self.metrics.step(train.step, loss=loss, world_size=self.world_size,
                              samples=train.data.cursor, step_s=now - self.last_done,
                              global_batch=spec.train.global_batch_size,
                              restart=self.restart, lr=step.lr, extra=user_metrics)
        self.last_done = now
        drain = totals[1] > 0
        # Drained only because a node joins (no rank was asked to stop): the state may stay in memory.
        in_memory = drain and not final and totals[5] == 0 and self._join_snapshot(train.step, settled=totals[6] == 0)
        blocking = (drain and not in_memory) or (final and spec.checkpoint.save_final)
        periodic = save_due_by_steps(spec.checkpoint.every_steps, train.step) or totals[2] > 0
        self._maybe_save(train.step, blocking=blocking, periodic=periodic)
        if not in_memory:
            self._snapshot(train.step, int(totals[3]), forced=blocking or periodic, copies_busy=totals[4] > 0,
                           copies_settled=totals[6] == 0)
        if drain and not final:
            if self.memory is not None:
                self.memory.settle(spec.timeouts.process_group)
            self.events.emit("drain", step=train.step, world_size=self.world_size,
                             saved="memory" if in_memory else "storage")
            step.drained = True
            return
        self.faults.after_step(train.step)

    # ----- the end ---------------------------------------------------------------------------
    def finish(self) -> None:
        """After the last step: wait for the save, digest the model, ``finish``."""
        if self.replicas is not None and self.replicas.pending:
            self.replicas.check(self.train.step)  # no save compared them: the digest must not hide it
        self.ckpt.wait()
        if self.memory is not None:
            self.memory.settle(self.spec.timeouts.process_group)
        digest = model_digest(self.model)
        self.events.emit("finish", step=self.train.step,
                         loss=None if self.last_loss is None else round(self.last_loss, 6),
                         digest=digest, samples=self.train.data.cursor, world_size=self.world_size)

    # ----- the parts -------------------------------------------------------------------------
    def _collect_totals(self, step: Step) -> torch.Tensor:
        """The step's reduced totals; a loss counted after they were started (a backward
        after the loop) is reduced now. Whether that happened depends on the script's
        structure (calls, not values), so every rank makes the same extra call."""
        self.share_totals(step)  # a loop that never finished step.batches(): start it here
        totals, work, loss_then, samples_then = step.shared
        work.wait()
        if step.samples != samples_then:
            late = step.loss_sum - loss_then
            dist.all_reduce(late)
            totals[0] += late
        return totals

    def _maybe_save(self, step: int, *, blocking: bool, periodic: bool) -> None:
        if step == self.last_saved_step or not (blocking or periodic):
            return
        if self.replicas is not None and self.replicas.pending:
            self.replicas.check(step)
        # A save may wait for the previous one or write synchronously: a longer budget.
        self.watchdog.arm(extra_s=self.spec.timeouts.process_group)
        if self.ckpt.save(step, self.state, blocking=blocking):
            self.last_save, self.last_saved_step = time.monotonic(), step
        self.watchdog.arm()

    def _join_snapshot(self, step: int, settled: bool = False) -> bool:
        """Collective (every rank, at a drain no rank was asked to stop for): a forced
        in-memory snapshot of ``step`` in place of the drain's storage save, when memory
        covers the next generation's restore (``join_in_memory``). True only if it did on
        every rank; any rank without it (layout, the tier off or failing, its slot still being
        sent) makes every rank save to storage as before. ``settled``: as ``MemoryTier.save``'s."""
        ok = False
        if self.join_in_memory and self.memory is not None:
            t0 = time.monotonic()
            ok = self.memory.save(step, self.state, send=False, settled=settled)
            self.snapshot_s = time.monotonic() - t0
            if ok:
                self.cadence.taken(step)
        missing = torch.tensor([float(not ok)], dtype=torch.float64)
        dist.all_reduce(missing)
        return missing.item() == 0

    def _snapshot(self, step: int, k: int, *, forced: bool, copies_busy: bool = False,
                  copies_settled: bool = False) -> None:
        """Copy the state into the in-memory tier if it is due (``cadence``: every rank
        decides alike, from the interval ``k`` rank 0 proposed in this step's all-reduce),
        and send it as a buddy copy unless some rank's copies still move or wait
        (``copies_busy``, from the same all-reduce: ``memtier.buddy.due``); ``copies_settled``:
        no rank's copies moved (``MemoryTier.save``)."""
        if self.memory is None:
            return
        changed = self.cadence.agree(k)
        if self.rank == 0:
            copy_s, step_s = self.cadence.medians()
            copies = self.memory.copy_every(step_s, self.spec.checkpoint.memory_budget)
            if changed or (copies is not None and copies[0] != self.copy_every):
                # Buddy copies: every ``copy_every`` steps at most (also when only that changed).
                self.copy_every = None if copies is None else copies[0]
                self.events.emit("memory", step=step, every=k, copy_s=round(copy_s, 5), step_s=round(step_s, 5),
                                 copy_every=self.copy_every,
                                 copy_cost_s=None if copies is None else round(copies[1], 5))
        if not self.cadence.due(step, forced):
            return
        t0 = time.monotonic()
        saved = self.memory.save(step, self.state, send=not copies_busy, settled=copies_settled)
        self.snapshot_s = time.monotonic() - t0  # left out of the step's time, copy included
        # The snapshot interval's budget is the own snapshot's; a copy's start has its own
        # (``memtier.buddy.hold``, over ``BuddyLink.copy_cost_s``).
        self.cadence.snapshot_took(self.snapshot_s - self.memory.copy_s)
        if saved:
            self.cadence.taken(step)
        link = self.memory.link
        if link is not None and link.announce and self.rank == 0 and link.held is not None:
            link.announce = False  # said once a generation: the memory the copies take
            self.events.emit("buddy", step=link.held[0], bytes=link.held[1], of_rank=link.source,
                             slots=len(self.memory.buddy_regions))
