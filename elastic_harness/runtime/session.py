"""The public API for your own training script: ``elastic_harness.init()`` returns a ``Run``.

A plain torchrun DDP/FSDP script keeps its model, optimizer, scheduler, loss and data, and
adds these calls (the DDP toy's conversion is +24/-24 lines; docs/script-api.md)::

    import elastic_harness as eh

    run = eh.init("jobs/my_job.yaml")                 # process group, device, run dir, policy
    model = DDP(Net().to(run.device), device_ids=run.device_ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run.register(model, optimizer, scheduler=scheduler)   # what the checkpoint holds
    for step in run.steps(train_set):                 # resumes, then one item per update
        for x, y in step.batches():
            with run.autocast():
                loss = F.mse_loss(model(x), y)
            step.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        step.done()                                   # save, drain, watchdog, metrics
    run.close()

What the run does, in order (every rank calls every method, in the same order):

1. ``init``: reads the launcher's environment once (``launch.env``), the job (the harness's
   resolved job when our agent started this process, else the ``job`` argument, else
   defaults plus ``overrides``), joins or creates the process group (explicit timeout) and a
   separate gloo group for checkpoints, seeds the RNG with ``train.seed`` (identical initial
   weights on every rank and restart), installs the SIGTERM drain and failure recording.
2. ``register``: checks what it is given (an optimizer over the model's own parameters, a
   scheduler of that optimizer whose state pickles) and builds the checkpointed state.
3. ``resume`` (called by ``steps`` if you do not): every rank restores from its agent's
   memory (``memtier``: after a worker crash; under DDP also at a new world size, ranks
   without a snapshot receiving it from a peer), else loads the newest complete, verified checkpoint through DCP, resharded
   to this world size, or starts fresh.
4. ``steps(dataset)``: one ``Step`` per remaining update; the data position is the global
   stream cursor (``data.sampler``; for a sharded stream ``data.order``, docs/streaming.md),
   so the same samples follow whatever the world size.
   After the last step: the final save, the model digest, the ``finish`` event. After a
   drain (SIGTERM, a membership change) it saves synchronously and raises
   ``SystemExit(143)``, so nothing after the loop runs on a drained generation.
5. ``close``: waits for the async save, closes metrics, destroys the groups it created.
"""

from __future__ import annotations

import atexit
import os
import random
import signal
import sys
import time
import typing
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from elastic_harness import jobkey, runfiles
from elastic_harness.checkpoint import collective
from elastic_harness.checkpoint.manager import CheckpointManager
from elastic_harness.checkpoint.storage import open_storage
from elastic_harness.checkpoint.where import checkpoint_root
from elastic_harness.data.adapters import source_of
from elastic_harness.data.epochs import unresolved_epochs
from elastic_harness.data.sampler import DataState, EpochOrder
from elastic_harness.data.stream import Stream
from elastic_harness.errors import CheckpointError, HarnessError, UsageError
from elastic_harness.events import EventLog
from elastic_harness.launch.env import WorkerEnv
from elastic_harness.memtier.cadence import Cadence
from elastic_harness.memtier.peer import Wire, replicated_layout
from elastic_harness.memtier.tier import MemoryTier, Restored, restored_message
from elastic_harness.rundir import check_paths
from elastic_harness.runtime import dist as hdist
from elastic_harness.runtime import evaluate as ev
from elastic_harness.runtime import failures, precision
from elastic_harness.runtime.audit import record_samples
from elastic_harness.runtime.buffers import BufferSync
from elastic_harness.runtime.digest import model_digest
from elastic_harness.runtime.faults import WorkerFaults
from elastic_harness.runtime.jobsource import resolve_job
from elastic_harness.runtime.loader import (
    StepLoader,
    StreamLoader,
    planner,
    stream_planner,
    to_device,
)
from elastic_harness.runtime.metrics import Metrics
from elastic_harness.runtime.registration import (
    check_registration,
    check_schedulers,
    distributed,
    replicas_differ,
    unwrapped_error,
)
from elastic_harness.runtime.seeding import seed_torch
from elastic_harness.runtime.state import TrainState, build_state
from elastic_harness.runtime.step import Step
from elastic_harness.runtime.stream_index import bind_stream
from elastic_harness.runtime.timer import ProgressWatchdog
from elastic_harness.runtime.topology import Topology
from elastic_harness.spec import JobSpec

DRAIN_EXIT = 128 + signal.SIGTERM
_ACTIVE: Run | None = None  # the one run of this process (failure records read its step)


class NullLog:
    def emit(self, event: str, **fields: Any) -> dict:
        return {}


def step_seed(seed: int, step: int, rank: int) -> int:
    """Per-step, per-rank RNG seed: randomness needs no checkpointing and replays exactly."""
    return ((seed * 1_000_003 + step) * 10_007 + rank) % (2**63 - 1)


def seed_everything(seed: int) -> None:
    seed_torch(seed)  # torch.manual_seed's effect, without its cost every step (runtime.seeding)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def save_due_by_steps(every: int, step: int) -> bool:
    return bool(every) and step % every == 0


def save_due_by_time(every_s: float, seconds_since_save: float) -> bool:
    """Decided on rank 0 only and shared with the step's all-reduce (clocks differ)."""
    return bool(every_s) and seconds_since_save >= every_s


def init(job: str | Path | JobSpec | None = None, *, run_dir: str | Path | None = None,
         overrides: Sequence[str] = (), argv: Sequence[str] | None = None) -> Run:
    """Start this process's part of the job (see the module docstring). Call once.

    ``job``: a YAML path or a ``JobSpec`` (``runtime.jobsource`` says which wins where).

    ``argv`` (e.g. ``sys.argv[1:]``): also read ``--job FILE``, ``--run-dir DIR`` and
    ``--set KEY=VALUE`` (repeatable) from the script's command line; the arguments it does not
    know are left in ``run.argv`` for the script's own parser.
    """
    global _ACTIVE
    if _ACTIVE is not None and not _ACTIVE.closed:
        raise UsageError("elastic_harness.init() was called twice", "call it once per process")
    rest: list[str] = []
    if argv is not None:
        job, run_dir, overrides, rest = _from_argv(argv, job, run_dir, overrides)
    env = WorkerEnv.from_environ(standalone_ok=True)
    try:
        spec, run_dir = resolve_job(env, job, run_dir, overrides)
        topology = Topology.from_env(env, spec.parallelism)  # the layout, built once, passed down
        if not env.by_harness:
            check_paths(Path(run_dir), spec)
    except HarnessError as e:
        _refuse(e, env)
    t0 = time.perf_counter()
    groups = hdist.init(env, spec.device, spec.timeouts.process_group)
    pg_init_s = time.perf_counter() - t0
    try:
        claim = None if env.by_harness else _prepare_standalone(spec, run_dir, env, groups.ckpt)
    except HarnessError as e:
        hdist.destroy(groups)
        _refuse(e, env)
    _ACTIVE = Run(spec, env, groups, run_dir, pg_init_s=pg_init_s, claim=claim, topology=topology)
    _ACTIVE.argv = rest
    return _ACTIVE


def _refuse(e: HarnessError, env: WorkerEnv) -> typing.NoReturn:
    """A mistake ``init`` found (the job, its overrides, the run dir). Under plain python or
    torchrun: one line, as ``elastic-harness run`` prints it, and exit 2 (not a traceback).
    Under our agent the host checked all this before starting it: let the entry record it."""
    if env.by_harness:
        raise e
    if env.rank == 0:  # every rank read the same job: one says it
        print(f"error: {e}", file=sys.stderr, flush=True)
    raise SystemExit(e.exit_code)


def _from_argv(argv: Sequence[str], job: Any, run_dir: Any, overrides: Sequence[str]) -> tuple:
    import argparse

    cli = argparse.ArgumentParser(add_help=False)
    cli.add_argument("--job", default=job)
    cli.add_argument("--run-dir", default=run_dir)
    cli.add_argument("--set", action="append", default=list(overrides), metavar="KEY=VALUE")
    known, rest = cli.parse_known_args(list(argv))
    return known.job, known.run_dir, known.set, rest


def _prepare_standalone(spec: JobSpec, run_dir: Path, env: WorkerEnv, group: Any) -> Any:
    """Under plain torchrun or python, rank 0 prepares and locks the run dir (for this
    torchrun submission, its rendezvous id); all ranks learn the result."""
    from elastic_harness.checkpoint.lock import Holder
    from elastic_harness.rundir import prepare

    problem, claim = None, None
    if env.rank == 0:
        try:
            holder = Holder.this_process(spec.name, env.run_id or f"python-{os.getpid()}")
            claim = prepare(run_dir, spec, holder=holder)
        except HarnessError as e:
            problem = (e.message, e.hint)
    box = [problem]
    dist.broadcast_object_list(box, group=group, group_src=0)
    if box[0] is not None:
        raise HarnessError(*box[0])
    return claim


class Drain:
    """SIGTERM/SIGINT set a flag; the step hook finishes the step, saves, and exits."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum: int, frame: object) -> None:
        self.requested = True

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Run:
    """One process's part of a job. Built by ``init``; see the module docstring."""

    def __init__(self, spec: JobSpec, env: WorkerEnv, groups: hdist.Groups, run_dir: Path,
                 pg_init_s: float = 0.0, claim: Any = None, topology: Topology | None = None) -> None:
        self.spec, self.env, self.groups, self.run_dir = spec, env, groups, Path(run_dir)
        # The parallel layout (runtime.topology): mesh degrees, groups, data-parallel rank/degree.
        self.topology = topology if topology is not None else Topology.from_env(env, spec.parallelism)
        self.claim = claim  # the run dir's lock, held by rank 0 under plain torchrun/python
        self.argv: list[str] = []  # command-line arguments init(argv=...) did not consume
        self.rank, self.world_size, self.local_rank = env.rank, env.world_size, env.local_rank
        self.device: torch.device = groups.device
        self.closed = False
        log = EventLog(self.run_dir / runfiles.EVENTS)
        self.log = log  # every rank may report a failure
        self.events = log if env.rank == 0 else NullLog()  # rank 0 narrates
        self.generation = self._agree_generation()
        self._announce(pg_init_s)
        precision.check(spec.train.precision, self.device)
        seed_everything(spec.train.seed)  # identical initial weights on every rank and restart
        self.drain = Drain()
        self.metrics = Metrics(self.events, self.run_dir, tensorboard=spec.metrics.tensorboard,
                               main=env.rank == 0)
        # One step watchdog per process: the loop re-arms it every step, and checkpoint I/O
        # re-arms it while bytes move (a big save or load is slow, not stuck).
        self.watchdog = ProgressWatchdog(env.timer_file, spec.timeouts.step)
        self.ckpt = CheckpointManager(
            open_storage(checkpoint_root(spec.checkpoint.dir, self.run_dir)), spec.checkpoint,
            rank=env.rank, world_size=env.world_size, group=groups.ckpt, events=self.events,
            info={"task": job_identity(spec), "parallelism": spec.parallelism, "job": spec.name},
            on_progress=lambda: self.watchdog.arm(extra_s=spec.timeouts.process_group),
            key=jobkey.read(jobkey.key_path(self.run_dir, {jobkey.KEY_FILE_VAR: env.key_file})),
            optional_keys=TrainState.OPTIONAL_KEYS,
        )
        self.memory = _memory_tier(spec, env, groups.ckpt, log)
        self.cadence = Cadence(spec.checkpoint.memory_every, spec.checkpoint.memory_budget,
                               spec.checkpoint.memory_probe)
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scaler: Any = precision.grad_scaler(spec.train.precision, self.device)
        self._state: dict[str, Any] | None = None
        self._registered: list[Any] = []  # the scheduler and extra objects register() named
        self._compare_replicas = False  # an unwrapped model on several ranks, not compared yet
        self._train = TrainState(DataState(spec.train.seed, 0), env.world_size)
        self._resumed = False
        self._resumed_at: int | None = None  # the step this attempt started from (crash loops)
        self._buffers: BufferSync | None = None
        self._last_loss: float | None = None
        # Our agent's entry records escaping exceptions itself; under plain torchrun or
        # python, the interpreter's last-chance hook does.
        self._previous_hook = sys.excepthook
        if not env.by_harness:
            sys.excepthook = self._excepthook
        atexit.register(self.close)

    # ----- properties ----------------------------------------------------------------
    @property
    def step(self) -> int:
        """Updates done so far (after ``resume``: the step the checkpoint was saved at)."""
        return self._train.step

    @property
    def device_ids(self) -> list[int] | None:
        """What ``DistributedDataParallel(device_ids=...)`` wants on this device."""
        return [self.device.index] if self.device.type == "cuda" else None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def autocast(self) -> Any:
        """The autocast context of ``train.precision`` (a no-op for fp32)."""
        return precision.autocast(self.spec.train.precision, self.device)

    # ----- what the checkpoint holds ---------------------------------------------------
    def register(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, scheduler: Any = None,
                 scaler: Any = None, **extra: Any) -> None:
        """Name the state a checkpoint holds; call once, after wrapping the model."""
        if self._state is not None:
            raise UsageError("run.register() was called twice", "register everything in one call")
        check_registration(model, optimizer, scheduler, extra)
        # Several data-parallel ranks (the world size today) and a bare model: compared
        # across ranks before the first save (``registration``).
        self._compare_replicas = self.world_size > 1 and not distributed(model)
        self._registered = [scheduler, *extra.values()]
        check_schedulers(optimizer, self._registered)
        if scaler is not None:
            self.scaler = scaler
        self.model, self.optimizer = model, optimizer
        self._buffers = BufferSync.of(model, self.world_size)
        self._state = build_state(model, optimizer, self._train, scheduler=scheduler,
                                  scaler=self.scaler, extra=extra)

    def resume(self, before_saying: Callable[[], None] | None = None) -> int:
        """Restore the newest snapshot every rank holds in memory, else load the newest
        complete, verified checkpoint (every rank); the step it holds. ``before_saying``
        (``steps``: binding the data to the restored position) runs before the ``resume``
        event, so a checkpoint the data cannot continue is refused before "resumed from"."""
        if self._resumed:
            return self._train.step
        if self._state is None:
            raise UsageError("run.resume()/run.steps() before run.register()",
                             "call run.register(model, optimizer, ...) first")
        check_schedulers(self.optimizer, self._registered)  # one built after register()
        self._resumed = True
        self.ckpt.join()  # every generation enters the fence, whichever tier restores it
        restored = None
        if self.memory is not None:
            restored = self.memory.restore(self._state, replicated=replicated_layout(
                self.spec.parallelism, self.model, self._state))
        if restored is not None:
            self._resumed_at = restored.step
            if before_saying is not None:
                before_saying()
            return self._resumed_from_memory(restored)
        loaded = self.ckpt.restore(self._state)
        self._resumed_at = loaded.step if loaded is not None else 0
        if loaded is None:
            if before_saying is not None:
                before_saying()
            self.events.emit("resume", fresh=True, step=0, world_size=self.world_size)
            return 0
        train = self._train
        # Before saying "resumed": a checkpoint of another data stream is refused first.
        reason = train.check_matches(self.spec.train.seed, None)
        if reason:
            raise CheckpointError(f"the checkpoint at step {train.step} cannot continue this "
                                  f"job: {reason}", "use a new --run-dir or --fresh")
        if before_saying is not None:
            before_saying()
        self.metrics.resumed_at(loaded.step)
        self.events.emit(
            "resume", step=loaded.step, source="storage", checkpoint=loaded.name,
            saved_world_size=train.saved_world_size,
            world_size=self.world_size, load_s=round(loaded.seconds, 4), samples=train.data.cursor,
            message=f"resumed from step {loaded.step}, saved at world size {train.saved_world_size}, "
            f"now {self.world_size}, load took {loaded.seconds:.2f} s",
        )
        return loaded.step

    def _resumed_from_memory(self, restored: Restored) -> int:
        self.metrics.resumed_at(restored.step)
        saved = self._train.saved_world_size
        self.events.emit(
            "resume", step=restored.step, source=restored.source, saved_world_size=saved,
            world_size=self.world_size, load_s=round(restored.seconds, 4), samples=self._train.data.cursor,
            senders=list(restored.senders), receivers=restored.receivers,
            message=restored_message(restored, saved, self.world_size),
        )
        return restored.step

    # ----- the loop --------------------------------------------------------------------
    def steps(self, dataset: Any, *, collate_fn: Callable | None = None) -> Iterator[Step]:
        """One ``Step`` per remaining update of ``train.steps`` (see ``runtime.step``).

        ``dataset``: a map-style dataset (``len`` and ``[i]``) or a sharded stream (a
        ``elastic_harness.data.Stream``, a Hugging Face streaming dataset, an
        ``IterableDataset`` with ``shards`` and ``open_shard``; ``data.adapters``)."""
        source = source_of(dataset)
        bound: list = []  # the shard list is checked before "resumed from ..." is said
        self.resume(before_saying=lambda: bound.append(self._bind_data(source, collate_fn)))
        loader = bound[0] if bound else self._bind_data(source, collate_fn)  # resumed earlier
        spec, train = self.spec, self._train
        watchdog = self.watchdog
        faults = WorkerFaults(spec.chaos, rank=self.rank, node=self.env.node,
                              local_rank=self.local_rank, marker_dir=self.run_dir / runfiles.CHAOS,
                              events=self.log, agent=self.env.agent_pid or os.getppid())
        self._loop = _LoopState(watchdog, faults, self._sample_log())
        self._loop.loader = loader
        self.cadence.start(train.step)
        try:
            while train.step < spec.train.steps:
                watchdog.arm()
                plan, batches = loader.next_step()
                seed_everything(step_seed(spec.train.seed, train.step, self.rank))
                step = Step(self, train.step + 1, plan, batches, lr=None)
                if self._loop.sample_log is not None:
                    # Before the step's compute, not in its hook: a step whose gradients were
                    # reduced then has every rank's line, even when a node dies right after
                    # (its peers may restore that step from memory).
                    record_samples(self._loop.sample_log, self.generation, step.number, self.rank,
                                   self.world_size, plan, loader.meta)
                yield step
                if not step.finished:
                    raise UsageError(f"the loop body of step {step.number} did not call step.done()",
                                     "call step.done() at the end of every iteration")
                if step.drained:
                    raise SystemExit(DRAIN_EXIT)
            watchdog.disarm()
            self._finish()
        finally:
            watchdog.disarm()
            loader.close()

    def _bind_data(self, source: Any, collate_fn: Callable | None) -> Any:
        """Check the saved position against the data (or start it) and build the loader."""
        spec, train = self.spec, self._train
        g, mb = spec.train.global_batch_size, spec.train.micro_batch_size
        common = dict(seed=spec.train.seed, device=self.device, collate=collate_fn,
                      workers=spec.data.workers, prefetch=spec.data.prefetch,
                      pin_memory=spec.data.pin_memory, record=spec.train.record_samples)
        if isinstance(source, Stream):
            order, digests = bind_stream(source, seed=spec.train.seed, global_batch=g,
                                         rank=self.rank, world_size=self.world_size,
                                         group=self.groups.ckpt, cache_dir=self.run_dir / "data",
                                         on_progress=lambda: self.watchdog.arm(
                                             extra_s=spec.timeouts.process_group))
            self._check_data(order.n, *digests)
            plan_of = stream_planner(order, train.data.cursor, train.step, g, self.world_size,
                                     self.rank, mb)
            return StreamLoader(source, order, plan_of, train.step, spec.train.steps,
                                world_size=self.world_size, **common)
        self._check_data(len(source), 0, 0)
        order = EpochOrder(spec.train.seed, len(source))
        plan_of = planner(order, train.data.cursor, train.step, g, self.world_size, self.rank, mb)
        return StepLoader(source, plan_of, train.step, spec.train.steps, **common)

    def _check_data(self, n: int, stream: int, layout: int) -> None:
        train = self._train
        if self.spec.train.epochs:  # `run`/`submit` resolve it; a bare eh.init(spec) did not
            raise unresolved_epochs(self.spec.train.epochs, n, self.spec.train.global_batch_size)
        if train.data.dataset_size == 0:  # fresh: nothing was loaded
            train.data = DataState(self.spec.train.seed, n)
            train.stream, train.layout = stream, layout
            return
        reason = train.check_matches(self.spec.train.seed, n, stream, layout)
        if reason:
            raise CheckpointError(f"the checkpoint at step {train.step} cannot continue this "
                                  f"job: {reason}", "use a new --run-dir or --fresh (or restore "
                                  "the data as it was)")

    def _after_step(self, step: Step, user_metrics: dict[str, float]) -> None:
        """The step hook's work (``Step.done``): counters, metrics, save, drain, faults."""
        spec, train, loop = self.spec, self._train, self._loop
        # The whole step, hook included, less the snapshot (``memtier.cadence``'s budget).
        now = time.monotonic()
        self.cadence.step_took(now - loop.period_start - loop.snapshot_s)
        loop.period_start, loop.snapshot_s = now, 0.0
        if self._buffers is not None:
            self._buffers.sync()
        train.step += 1
        train.data = train.data.advance(spec.train.global_batch_size)
        totals = self._collect_totals(step)
        now = time.monotonic()
        loss = float(totals[0]) / spec.train.global_batch_size
        self._last_loss = loss
        final = train.step == spec.train.steps
        if train.step % spec.train.log_every == 0 or final:
            self.metrics.step(train.step, loss=loss, world_size=self.world_size,
                              samples=train.data.cursor, step_s=now - loop.last_done,
                              global_batch=spec.train.global_batch_size,
                              restart=self.env.restart_count, lr=step.lr, extra=user_metrics)
        loop.last_done = now
        drain = totals[1] > 0
        blocking = drain or (final and spec.checkpoint.save_final)
        periodic = save_due_by_steps(spec.checkpoint.every_steps, train.step) or totals[2] > 0
        self._maybe_save(train.step, blocking=blocking, periodic=periodic)
        self._snapshot(train.step, int(totals[3]), forced=blocking or periodic)
        if drain and not final:
            self.events.emit("drain", step=train.step, world_size=self.world_size)
            step.drained = True
            return
        loop.faults.after_step(train.step)

    def _snapshot(self, step: int, k: int, *, forced: bool) -> None:
        """Copy the state into the in-memory tier if it is due (``cadence``: every rank
        decides alike, from the interval ``k`` rank 0 proposed in this step's all-reduce)."""
        if self.memory is None:
            return
        if self.cadence.agree(k) and self.rank == 0:
            copy_s, step_s = self.cadence.medians()
            self.events.emit("memory", step=step, every=k, copy_s=round(copy_s, 5), step_s=round(step_s, 5))
        if not self.cadence.due(step, forced):
            return
        t0 = time.monotonic()
        self.memory.save(step, self._state)
        self._loop.snapshot_s = time.monotonic() - t0
        self.cadence.snapshot_took(self._loop.snapshot_s)
        self.cadence.taken(step)

    def _share_totals(self, step: Step) -> None:
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
                                                         time.monotonic() - self._loop.last_save))
        k = float(self.cadence.proposal(step.number) if self.rank == 0 and self.memory is not None else 0)
        totals = torch.tensor([float(step.loss_sum), float(self.drain.requested), flag, k],
                              dtype=torch.float64)
        work = dist.all_reduce(totals, async_op=True)
        step.shared = (totals, work, step.loss_sum.clone(), step.samples)

    def _collect_totals(self, step: Step) -> torch.Tensor:
        """The step's reduced totals; a loss counted after they were started (a backward
        after the loop) is reduced now. Whether that happened depends on the script's
        structure (calls, not values), so every rank makes the same extra call."""
        self._share_totals(step)  # a loop that never finished step.batches(): start it here
        totals, work, loss_then, samples_then = step.shared
        work.wait()
        if step.samples != samples_then:
            late = step.loss_sum - loss_then
            dist.all_reduce(late)
            totals[0] += late
        return totals

    def _maybe_save(self, step: int, *, blocking: bool, periodic: bool) -> None:
        loop = self._loop
        if step == loop.last_saved_step or not (blocking or periodic):
            return
        if self._compare_replicas:
            self._check_replicas(step)
        # A save may wait for the previous one or write synchronously: a longer budget.
        loop.watchdog.arm(extra_s=self.spec.timeouts.process_group)
        if self.ckpt.save(step, self._state, blocking=blocking):
            loop.last_save, loop.last_saved_step = time.monotonic(), step
        loop.watchdog.arm()

    def _check_replicas(self, step: int) -> None:
        """Before the first save of an unwrapped model (``registration``): every rank."""
        self._compare_replicas = False
        differ = replicas_differ(self.model, lambda d: collective.all_gather(d, self.groups.ckpt,
                                                                              self.world_size))
        if differ:
            raise unwrapped_error(self.model, step, differ)

    def _finish(self) -> None:
        if self._compare_replicas:  # no save compared them: the final digest must not hide it
            self._check_replicas(self._train.step)
        self.ckpt.wait()
        digest = model_digest(self.model)
        self.events.emit("finish", step=self._train.step,
                         loss=None if self._last_loss is None else round(self._last_loss, 6),
                         digest=digest, samples=self._train.data.cursor, world_size=self.world_size)

    def _sample_log(self) -> Path | None:
        if not self.spec.train.record_samples:
            return None
        (self.run_dir / runfiles.SAMPLES).mkdir(exist_ok=True)
        return self.run_dir / runfiles.SAMPLES / f"rank-{self.rank}.jsonl"

    # ----- evaluation --------------------------------------------------------------------
    def evaluate(self, dataset: Any, fn: Callable[[Any], dict[str, torch.Tensor]], *,
                 collate_fn: Callable | None = None) -> dict[str, float]:
        """Every rank: ``fn(batch) -> {metric: per-sample tensor}`` over a split of
        ``dataset``, in eval mode and without gradients; the exact means over all of it,
        logged as an ``eval`` event and to TensorBoard."""
        from torch.utils.data import default_collate

        t0 = time.perf_counter()
        size = self.spec.eval.batch_size or self.spec.train.micro_batch_size
        batches = ev.eval_batches(len(dataset), self.world_size, self.rank, size)
        model = self.model
        was_training = model.training if model is not None else False
        if model is not None:
            model.eval()
        try:
            with torch.no_grad(), self.autocast():
                sums, count = ev.run_eval(dataset, _guarded(fn), batches, collate_fn or default_collate,
                                          lambda b: to_device(b, self.device))
        finally:
            if model is not None:
                model.train(was_training)
        metrics = ev.reduce_metrics(sums, count)
        self.metrics.evaluation(self._train.step, metrics, time.perf_counter() - t0)
        return metrics

    # ----- the end -----------------------------------------------------------------------
    def close(self) -> None:
        """Finish the in-flight save, close metrics, destroy our groups; safe to call twice."""
        if self.closed:
            return
        self.closed = True
        try:
            self.ckpt.close()
            self.metrics.close()
            if self.memory is not None:
                self.memory.close()
        finally:
            self.drain.restore()
            sys.excepthook = self._previous_hook
            hdist.destroy(self.groups)
            if self.claim is not None:
                self.claim.release()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def record_failure(self, exc: BaseException) -> None:
        failures.record(self.log, exc, rank=self.rank, step=self._train.step, node=self.env.node,
                        restart=self.env.restart_count, generation=self.generation,
                        resumed_at=self._resumed_at)

    def _excepthook(self, kind: type, exc: BaseException, tb: Any) -> None:
        """Plain torchrun/python: record the failure; a user's mistake is one line, exit 2."""
        self.record_failure(exc)
        if not isinstance(exc, HarnessError):
            self._previous_hook(kind, exc, tb)
            return
        prefix = f"[rank {self.rank}] " if self.world_size > 1 else ""
        print(f"{prefix}error: {exc}", file=sys.stderr, flush=True)
        self.close()
        os._exit(exc.exit_code)  # the interpreter would exit 1; a mistake to fix is 2

    def _agree_generation(self) -> str:
        """A fresh id for this worker generation, the same on every rank (for audits)."""
        box = [uuid.uuid4().hex[:12] if self.rank == 0 else None]
        dist.broadcast_object_list(box, group=self.groups.ckpt, group_src=0)
        return box[0]

    def _announce(self, pg_init_s: float) -> None:
        env = self.env
        self.log.emit("worker", rank=env.rank, local_rank=env.local_rank, group_rank=env.group_rank,
                      node=env.node, restart=env.restart_count, world_size=env.world_size)
        if not env.by_harness and env.restart_count == 0:
            self.events.emit("start", who="script", nodes=env.world_size // max(env.local_world_size, 1),
                             nproc_per_node=env.local_world_size, run_id=env.run_id,
                             run_dir=str(self.run_dir))
        self.events.emit("rendezvous", generation=self.generation, world_size=env.world_size,
                         restart=env.restart_count, nodes=env.world_size // max(env.local_world_size, 1),
                         pg_init_s=round(pg_init_s, 3))


class _LoopState:
    """What ``steps`` keeps between step hooks (one instance per ``steps`` call)."""

    def __init__(self, watchdog: ProgressWatchdog, faults: WorkerFaults, sample_log: Path | None) -> None:
        self.watchdog, self.faults, self.sample_log = watchdog, faults, sample_log
        now = time.monotonic()
        self.last_save = self.last_done = self.period_start = now
        self.snapshot_s = 0.0  # the last hook's in-memory snapshot (not part of a step's time)
        self.last_saved_step = -1
        self.loader: Any = None  # StepLoader or StreamLoader (its ``meta`` feeds the audit)


def _memory_tier(spec: JobSpec, env: WorkerEnv, group: Any, log: EventLog) -> MemoryTier | None:
    """The in-memory tier when our agent runs this worker and the job wants it. The same on
    every rank (restoring is collective): a rank whose slots cannot be opened has none."""
    if not (env.by_harness and spec.checkpoint.memory_every > 0):
        return None
    return MemoryTier.open(env.memory, env.local_rank, rank=env.rank, world_size=env.world_size,
                           wire=Wire.of(group, env.world_size),
                           warn=lambda message: log.emit("warning", message=message))


def job_identity(spec: JobSpec) -> str:
    """What a checkpoint records as its producer: the task target, or the script's name."""
    return spec.task.target or f"script:{Path(spec.script.path).name}"


def _guarded(fn: Callable) -> Callable:
    """Name the user's evaluate in whatever it raises. Not fatal at once: a peer that died
    mid-evaluation also surfaces here, as a collective error; a bug in evaluate fails the
    same way on the next attempt, and the agent stops on that crash loop (one line)."""

    def call(batch: Any) -> Any:
        try:
            return fn(batch)
        except HarnessError:
            raise
        except Exception as e:
            d = failures.describe(e)
            raise ev.EvaluateError(f"evaluate raised {d['message']} (at {d['where']})") from e

    return call


def active() -> Run | None:
    """The run of this process, if ``init`` was called (closed or not)."""
    return _ACTIVE
