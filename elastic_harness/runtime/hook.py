"""The step hook: what ``Step.done()`` sets off, every rank, after each optimizer step.

One ``StepHook`` per ``Run.steps`` call, built from what it needs (the run hands over its
parts: nothing here reaches back into the ``Run``). In order, for each step:

1. the step's time goes to the snapshot cadence (``memtier.cadence``; the snapshot itself
   is not part of it);
2. persistent buffers are set to rank 0's copy (``runtime.buffers``);
3. the counters advance (step, data cursor); where a failing rank keeps its last step
   (``memory_on_failure``), the in-memory tier is armed with this step (``MemoryTier.arm``:
   the state's tensors by reference, its plain values pickled) until the optimizer's next
   step disarms it; the step's one all-reduce is collected: the
   ranks' ``StepVote`` (``runtime.vote``: loss, drain and stop requests, a time-based save
   due, the snapshot interval, buddy copies busy or moving). ``start_vote`` starts it
   without waiting when ``step.batches()`` ends (``runtime.step``), so it completes while
   the optimizer steps;
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
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elastic_harness.checkpoint import collective
from elastic_harness.checkpoint.manager import Saver
from elastic_harness.memtier.cadence import Cadence
from elastic_harness.memtier.tier import MemoryTier
from elastic_harness.runtime.buffers import BufferSync
from elastic_harness.runtime.digest import model_digest
from elastic_harness.runtime.faults import WorkerFaults
from elastic_harness.runtime.metrics import Metrics, StepFigures
from elastic_harness.runtime.registration import replicas_differ, unwrapped_error
from elastic_harness.runtime.state import TrainState
from elastic_harness.runtime.step import Step
from elastic_harness.runtime.timer import ProgressWatchdog
from elastic_harness.runtime.topology import Topology
from elastic_harness.runtime.vote import StepVote
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


@dataclass(frozen=True)
class Trained:
    """What the steps train and a save holds (``Run.register``'s objects)."""

    state: dict[str, Any]  # what a checkpoint or snapshot holds (``runtime.state.build_state``)
    train: TrainState  # the position in it: step, data cursor
    model: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    scaler: Any = None
    buffers: BufferSync | None = None  # persistent buffers set to rank 0's copy every step
    replicas: ReplicaCheck | None = None  # an unwrapped model, compared before the first save


@dataclass(frozen=True)
class Keeping:
    """Where the state is kept: storage checkpoints, and the in-memory tier with its cadence."""

    ckpt: Saver
    memory: MemoryTier | None
    cadence: Cadence
    join_in_memory: bool = False  # memory covers a join's restore (``resume.memory_covers_join``)
    # A failing rank keeps its last step (``resume.memory_covers_failure``): armed every step
    on_failure: bool = False


@dataclass(frozen=True)
class Signals:
    """What reaches the loop from outside it: drain and stop requests, the step watchdog, the
    job's scheduled faults."""

    drain_requested: Callable[[], bool]
    # A drain is a stop (storage save) unless every rank's request was a join's only; None:
    # every drain is a stop (a caller that knows no join signal).
    stop_requested: Callable[[], bool] | None = None
    watchdog: ProgressWatchdog | None = None
    faults: WorkerFaults | None = None
    # Why the generation cannot go on (a collective failed or was left: in-place recovery,
    # ``runtime.inplace``), or None; a step that sees it counts nothing and is thrown away.
    broken: Callable[[], str | None] = lambda: None
    # The run's way to finish the step in flight in place (``runtime.repoint``): given the
    # step, its extra micro-batches and their end, or None (the step is thrown away).
    in_flight: Callable[[Any], Any] = lambda step: None
    # HSDP's replica all-reduce, deferred to a step's end, with the shard-local gradients kept
    # before it (``runtime.inflight.KeptShards``), or None
    replicas: Any = None

    def stop(self) -> bool:
        return (self.stop_requested or self.drain_requested)()


@dataclass(frozen=True)
class Reporting:
    """Where a step is told: the event log (rank 0 narrates) and the metrics."""

    events: Any
    metrics: Metrics | None
    restart: int = 0  # the agent's restart count, in every step's metrics


class StepHook:
    """What ``Step`` calls (``runtime.step.Owner``): ``start_vote`` when its micro-batches
    end, ``after_step`` from ``done``. Also what a step reads of its run (``spec``,
    ``dp_size``, ``model``, ``optimizer``, ``scaler``).

    ``topology`` (``runtime.topology``) says who this process is: ``rank`` and
    ``world_size`` are processes (the events' fields), ``dp_size`` the data-parallel degree
    the loss is scaled by. The other parts are built once by the run (``Run.steps``)."""

    def __init__(self, spec: JobSpec, topology: Topology, trained: Trained, keeping: Keeping,
                 signals: Signals, reporting: Reporting) -> None:
        self.spec, self.topology = spec, topology
        self.trained, self.keeping, self.signals, self.reporting = trained, keeping, signals, reporting
        self.model, self.optimizer, self.scaler = trained.model, trained.optimizer, trained.scaler
        self.rank, self.world_size, self.dp_size = topology.rank, topology.world_size, topology.dp_degree
        self.memory, self.cadence = keeping.memory, keeping.cadence  # read at every step
        now = time.monotonic()
        self.last_save = self.last_done = self.period_start = now
        self.snapshot_s = 0.0  # the last hook's in-memory snapshot (not part of a step's time)
        self.copy_every: int | None = None  # buddy copies' interval last reported (rank 0)
        self.last_saved_step = -1
        self.last_loss: float | None = None
        self._disarm = None  # the optimizer's step pre-hook that disarms the tier (``close``)
        if keeping.on_failure and self.memory is not None:
            keeping.cadence.cover(True)
            if self.optimizer is not None:
                memory = self.memory
                self._disarm = self.optimizer.register_step_pre_hook(lambda *_: memory.disarm())

    # ----- what Step calls -----------------------------------------------------------------
    def start_vote(self, step: Step) -> None:
        """Start the step's one all-reduce, the ranks' ``StepVote``, without waiting for it
        (``Step.batches``).

        Waiting for it in the step hook made every step meet its peers twice (the gradient
        all-reduce, then this): whatever the ranks drifted apart during the optimizer step
        was paid again as a wait (``bench throughput``). Started right after the last
        backward, it is done by the time ``done`` needs it. Every rank starts it at the
        same point of the same step, so collectives keep their order.
        """
        if step.shared is not None:
            return
        totals = self._my_vote(step).pack()
        work = dist.all_reduce(totals, async_op=True)
        step.shared = (totals, work, step.loss_sum.clone(), step.samples)

    def _my_vote(self, step: Step) -> StepVote:
        """This rank's say; rank 0 decides what clocks and timings decide (they differ)."""
        main, memory, ckpt = self.rank == 0, self.memory, self.spec.checkpoint
        return StepVote(
            loss_sum=float(step.loss_sum), drain=self.signals.drain_requested(), stop=self.signals.stop(),
            save_due=main and save_due_by_time(ckpt.every_seconds, time.monotonic() - self.last_save),
            snapshot_every=self.cadence.proposal(step.number) if main and memory is not None else 0,
            # Buddy copies moving, or (rank 0) not due yet within the tier's budget (``buddy.due``).
            copies_busy=memory is not None and (memory.busy(step.number, self.cadence.medians()[1],
                                                            ckpt.memory_budget) if main else memory.busy()),
            # Copies moving (not merely held): none anywhere means the last one is complete on every
            # rank, and the own snapshots it needs may move on (``MemoryTier.save``'s ``settled``).
            copies_moving=memory is not None and memory.moving())

    def after_backward(self) -> None:
        """After each micro-batch's backward (``Step.backward``): a generation that broke
        under it (in place) keeps the step the tier was armed with now, before the optimizer's
        step changes the state on gradients that were never reduced."""
        if self.keeping.on_failure and self.memory is not None and self.signals.broken() is not None:
            self.memory.keep_armed()

    def begin_batches(self, step: Step) -> None:
        """A step's micro-batches start (``Step.batches``): HSDP defers its replica all-reduce."""
        if self.signals.replicas is not None:
            self.signals.replicas.begin(step.number)

    def end_batches(self, reduce: bool = True) -> None:
        """Their last backward is done: HSDP keeps the shard-local gradients and all-reduces them
        over the replicas (``reduce``; without it, a loop left early: only stop deferring)."""
        if self.signals.replicas is not None:
            self.signals.replicas.end(self.model if reduce else None)

    def finish_in_flight(self, step: Step) -> Any:
        """After this rank's micro-batches (``Step.batches``): when the generation broke under
        the step, what finishes it in place (``runtime.inflight``), or None."""
        if self.signals.broken() is None:
            return None
        return self.signals.in_flight(step)

    def after_step(self, step: Step, user_metrics: dict[str, float]) -> None:
        """The step hook's work (``Step.done``): counters, metrics, save, drain, faults. A
        step whose generation broke (in place) counts nothing: it is thrown away."""
        train = self.trained.train
        if step.thrown:  # re-formed already, the step to be redone
            return
        self._time_step()
        if self.trained.buffers is not None:
            self.trained.buffers.sync()
        vote = self._collect_vote(step)
        if self.signals.broken() is not None:
            step.thrown = True
            return
        train.step += 1
        train.data = train.data.advance(self.spec.train.global_batch_size)
        if self._disarm is not None and self.cadence.active and self.cadence.arming(train.step):
            t0 = time.monotonic()  # (not in a probe's off block)
            self.memory.arm(train.step, self.trained.state)  # kept if this rank fails before its next step
            self.cadence.arm_took(time.monotonic() - t0)
        final = train.step == self.spec.train.steps
        self._report(step, vote, final, user_metrics)
        in_memory = self._keep(train.step, vote, final=final)
        if vote.drain and not final:
            # Every rank drains at this step: a save still in flight finishes here, in its own
            # generation (a worker kept in place would otherwise re-form under it, and the save
            # be refused half-way: ``torchcompat.groups.pinned``).
            self.keeping.ckpt.wait()
            if self.memory is not None:
                self.memory.settle(self.spec.timeouts.process_group)
            self.reporting.events.emit("drain", step=train.step, world_size=self.world_size,
                                       saved="memory" if in_memory else "storage")
            step.drained = True
            return
        self.signals.faults.after_step(train.step)

    # ----- the end ---------------------------------------------------------------------------
    def finish(self) -> None:
        """After the last step: wait for the save, digest the model, ``finish``."""
        replicas, train = self.trained.replicas, self.trained.train
        if replicas is not None and replicas.pending:
            replicas.check(train.step)  # no save compared them: the digest must not hide it
        self.keeping.ckpt.wait()
        if self.memory is not None:
            self.memory.settle(self.spec.timeouts.process_group)
        digest = model_digest(self.model)
        self.reporting.events.emit("finish", step=train.step,
                                   loss=None if self.last_loss is None else round(self.last_loss, 6),
                                   digest=digest, samples=train.data.cursor, world_size=self.world_size)

    def close(self) -> None:
        """The loop ended: the optimizer's steps no longer concern this hook."""
        if self._disarm is not None:
            self._disarm.remove()
            self._disarm = None
        if self.memory is not None:
            self.memory.disarm()

    # ----- the parts -------------------------------------------------------------------------
    def _time_step(self) -> None:
        """The whole step, hook included, less the snapshot (``memtier.cadence``'s budget)."""
        now = time.monotonic()
        self.cadence.step_took(now - self.period_start - self.snapshot_s)
        self.period_start, self.snapshot_s = now, 0.0

    def _collect_vote(self, step: Step) -> StepVote:
        """The step's reduced vote; a loss counted after it was started (a backward after the
        loop) is reduced now. Whether that happened depends on the script's structure
        (calls, not values), so every rank makes the same extra call."""
        self.start_vote(step)  # a loop that never finished step.batches(): start it here
        totals, work, loss_then, samples_then = step.shared
        work.wait()
        vote = StepVote.unpack(totals)
        if step.samples != samples_then:
            late = step.loss_sum - loss_then
            dist.all_reduce(late)
            vote = replace(vote, loss_sum=vote.loss_sum + float(late))
        return vote

    def _report(self, step: Step, vote: StepVote, final: bool, user_metrics: dict[str, float]) -> None:
        """The step's metrics (every ``train.log_every`` and at the last step). The ranks of a
        tensor group each count the same samples' loss: the reported mean divides them out."""
        spec, train, now = self.spec, self.trained.train, time.monotonic()
        self.last_loss = vote.loss_sum / (spec.train.global_batch_size * self.topology.ranks_per_share)
        if train.step % spec.train.log_every == 0 or final:
            figures = StepFigures(self.last_loss, self.world_size, train.data.cursor, now - self.last_done,
                                  spec.train.global_batch_size, self.reporting.restart, step.lr, user_metrics)
            self.reporting.metrics.step(train.step, figures)
        self.last_done = now

    def _keep(self, step: int, vote: StepVote, *, final: bool) -> bool:
        """A durable save if one is due, then the in-memory snapshot if due; True when a
        drain only for a node joining (no rank was asked to stop) kept the state in memory
        instead of storage."""
        spec = self.spec
        in_memory = (vote.drain and not final and not vote.stop
                     and self._join_snapshot(step, settled=not vote.copies_moving))
        blocking = (vote.drain and not in_memory) or (final and spec.checkpoint.save_final)
        periodic = save_due_by_steps(spec.checkpoint.every_steps, step) or vote.save_due
        self._maybe_save(step, blocking=blocking, periodic=periodic)
        if not in_memory:
            self._snapshot(step, vote.snapshot_every, forced=blocking or periodic, copies_busy=vote.copies_busy,
                           copies_settled=not vote.copies_moving)
        return in_memory

    def _maybe_save(self, step: int, *, blocking: bool, periodic: bool) -> None:
        if step == self.last_saved_step or not (blocking or periodic):
            return
        replicas, watchdog = self.trained.replicas, self.signals.watchdog
        if replicas is not None and replicas.pending:
            replicas.check(step)
        # A save may wait for the previous one or write synchronously: a longer budget, measured.
        sync = blocking or not self.spec.checkpoint.async_save
        with watchdog.save("blocking" if sync else "async"):
            if self.keeping.ckpt.save(step, self.trained.state, blocking=blocking):
                self.last_save, self.last_saved_step = time.monotonic(), step

    def _join_snapshot(self, step: int, settled: bool = False) -> bool:
        """Collective (every rank, at a drain no rank was asked to stop for): a forced
        in-memory snapshot of ``step`` in place of the drain's storage save, when memory
        covers the next generation's restore (``join_in_memory``). True only if it did on
        every rank; any rank without it (layout, the tier off or failing, its slot still being
        sent) makes every rank save to storage as before. ``settled``: as ``MemoryTier.save``'s."""
        ok = False
        if self.keeping.join_in_memory and self.memory is not None:
            t0 = time.monotonic()
            ok = self.memory.save(step, self.trained.state, send=False, settled=settled)
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
            self._report_cadence(step, k, changed)
        if not self.cadence.due(step, forced):
            return
        t0 = time.monotonic()
        saved = self.memory.save(step, self.trained.state, send=not copies_busy, settled=copies_settled)
        self.snapshot_s = time.monotonic() - t0  # left out of the step's time, copy included
        # The snapshot interval's budget is the own snapshot's; a copy's start has its own
        # (``memtier.buddy.hold``, over ``BuddyLink.copy_cost_s``).
        self.cadence.snapshot_took(self.snapshot_s - self.memory.copy_s)
        if saved:
            self.cadence.taken(step)
        self._report_copies()

    def _report_cadence(self, step: int, k: int, changed: bool) -> None:
        """Rank 0: the ``memory`` event when the snapshot interval, or the buddy copies' own
        (every ``copy_every`` steps at most), changed."""
        copy_s, step_s = self.cadence.medians()
        copies = self.memory.copy_every(step_s, self.spec.checkpoint.memory_budget)
        if changed or (copies is not None and copies[0] != self.copy_every):
            self.copy_every = None if copies is None else copies[0]
            self.reporting.events.emit("memory", step=step, every=k, copy_s=round(copy_s, 5),
                                       step_s=round(step_s, 5), copy_every=self.copy_every,
                                       copy_cost_s=None if copies is None else round(copies[1], 5))

    def _report_copies(self) -> None:
        """Rank 0, once a generation: the memory the buddy copies take (``buddy`` event)."""
        link = self.memory.link
        if link is not None and link.announce and self.rank == 0 and link.held is not None:
            link.announce = False
            self.reporting.events.emit("buddy", step=link.held[0], bytes=link.held[1], of_rank=link.source,
                                       slots=len(self.memory.buddy_regions))
