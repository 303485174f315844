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

This module is the script's API; the work behind it lives apart: ``runtime.resume`` (where a
generation starts from, and the data-position checks), ``runtime.hook`` (what each
``step.done()`` does: counters, metrics, saves, snapshots, drain, faults) and
``runtime.step`` (one step's micro-batches and loss scaling).
"""

from __future__ import annotations

import atexit
import os
import random
import secrets
import signal
import sys
import time
import typing
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
from elastic_harness.data.sampler import DataState
from elastic_harness.errors import HarnessError, UsageError
from elastic_harness.events import EventLog
from elastic_harness.launch.env import JOIN_SIGNAL, WorkerEnv
from elastic_harness.memtier.cadence import Cadence
from elastic_harness.memtier.conduit import local_address
from elastic_harness.memtier.peer import Wire
from elastic_harness.memtier.tier import MemoryTier
from elastic_harness.rundir import check_paths
from elastic_harness.runtime import dist as hdist
from elastic_harness.runtime import evaluate as ev
from elastic_harness.runtime import failures, precision
from elastic_harness.runtime.audit import record_samples
from elastic_harness.runtime.buffers import BufferSync
from elastic_harness.runtime.faults import WorkerFaults
from elastic_harness.runtime.hook import (
    Keeping,
    ReplicaCheck,
    Reporting,
    Signals,
    StepHook,
    Trained,
    save_due_by_steps,
    save_due_by_time,
)
from elastic_harness.runtime.jobsource import resolve_job, script_flags
from elastic_harness.runtime.loader import StepLoader, StreamLoader, to_device
from elastic_harness.runtime.mesh import build_mesh
from elastic_harness.runtime.metrics import Metrics
from elastic_harness.runtime.registration import (
    check_registration,
    check_schedulers,
    distributed,
    short_schedule,
    short_schedule_error,
)
from elastic_harness.runtime.resume import (
    announce,
    bind_data,
    memory_covers_failure,
    memory_covers_join,
    restore,
)
from elastic_harness.runtime.seeding import seed_torch
from elastic_harness.runtime.state import TrainState, build_state
from elastic_harness.runtime.step import Step
from elastic_harness.runtime.timer import ProgressWatchdog
from elastic_harness.runtime.topology import Topology
from elastic_harness.spec import JobSpec

__all__ = ["DRAIN_EXIT", "Run", "active", "check_registration", "init", "job_identity",
           "save_due_by_steps", "save_due_by_time", "seed_everything", "step_seed"]

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
        job, run_dir, overrides, rest = script_flags(argv, job, run_dir, overrides)
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
    """SIGTERM/SIGINT set a flag; the step hook finishes the step, saves, and exits.

    ``JOIN_SIGNAL`` asks for the same drain for a membership change only (a node waits to
    join; the agent sends it, then waits for its workers to exit): ``stop`` stays False, so
    the hook may keep the drain's state in memory instead of storage. Any SIGTERM/SIGINT,
    before or after, makes it a stop (preemption, the end of the run)."""

    def __init__(self) -> None:
        self.requested = False
        self.stop = False  # a SIGTERM/SIGINT came: the drain saves to storage
        self._previous = {sig: signal.signal(sig, self._handle)
                          for sig in (signal.SIGTERM, signal.SIGINT, JOIN_SIGNAL)}

    def _handle(self, signum: int, frame: object) -> None:
        self.requested = True
        if signum != JOIN_SIGNAL:
            self.stop = True

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
        # Processes: who this one is among all of them (collectives, files, events). The data
        # split, the loss scale and evaluation use the data-parallel rank and degree instead.
        self.rank, self.world_size, self.local_rank = self.topology.rank, self.topology.world_size, env.local_rank
        self.device: torch.device = groups.device
        # A mesh layout's DeviceMesh (runtime.mesh), built here on every rank: building is collective.
        self.mesh: Any = build_mesh(self.topology, self.device.type) if self.topology.kind == "mesh" else None
        self.closed = False
        self._kept: int | None = None  # the step kept in memory on a failure (``_keep_on_failure``)
        log = EventLog(self.run_dir / runfiles.EVENTS)
        self.log = log  # every rank may report a failure
        self.events = log if self.rank == 0 else NullLog()  # rank 0 narrates
        self.generation = self._agree_generation()
        self._announce(pg_init_s)
        precision.check(spec.train.precision, self.device)
        seed_everything(spec.train.seed)  # identical initial weights on every rank and restart
        self.drain = Drain()
        self.metrics = Metrics(self.events, self.run_dir, tensorboard=spec.metrics.tensorboard,
                               main=self.rank == 0)
        # One step watchdog per process: the loop re-arms it every step, and checkpoint I/O
        # re-arms it while bytes move (a big save or load is slow, not stuck).
        self.watchdog = ProgressWatchdog(env.timer_file, spec.timeouts.step)
        key = jobkey.read(jobkey.key_path(self.run_dir, {jobkey.KEY_FILE_VAR: env.key_file}))
        self.ckpt = _checkpoints(spec, self.run_dir, self.topology, groups.ckpt, self.events, self.watchdog, key)
        self.memory = _memory_tier(spec, env, self.topology, groups.ckpt, log, self.generation, key)
        self.cadence = Cadence(spec.checkpoint.memory_every, spec.checkpoint.memory_budget,
                               spec.checkpoint.memory_probe)
        self._start_registry()
        self._start_loop()

    def _start_registry(self) -> None:
        """Nothing registered yet: ``register`` names the model, optimizer and the rest."""
        spec = self.spec
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scaler: Any = precision.grad_scaler(spec.train.precision, self.device)
        self._state: dict[str, Any] | None = None
        self._registered: list[Any] = []  # the scheduler and extra objects register() named
        self._replicas: ReplicaCheck | None = None  # an unwrapped model on several ranks
        # The position is global (a stream cursor); the process count is saved for reports.
        self._train = TrainState(DataState(spec.train.seed, 0), self.world_size)
        self._resumed = False
        self._resumed_at: int | None = None  # the step this attempt started from (crash loops)
        self._buffers: BufferSync | None = None

    def _start_loop(self) -> None:
        """No loop yet; failures recorded on the way out, ``close`` at the interpreter's exit."""
        # Our agent's entry records escaping exceptions itself; under plain torchrun or
        # python, the interpreter's last-chance hook does.
        self._previous_hook = sys.excepthook
        if not self.env.by_harness:
            sys.excepthook = self._excepthook
        # The loop (``steps``): the open one, the step it yielded last, whether the job's last
        # step was done in this process, where the script left a loop early (a break).
        self._loop: Iterator[Step] | None = None
        self._yielded: Step | None = None
        self._loop_done = False
        self._left_loop_at: int | None = None
        self._quiet_close = False  # closing on the way down (an exception, the interpreter's exit)
        atexit.register(self._close_at_exit)

    # ----- properties ----------------------------------------------------------------
    @property
    def step(self) -> int:
        """Updates done so far (after ``resume``: the step the checkpoint was saved at)."""
        return self._train.step

    @property
    def dp_degree(self) -> int:
        """How many data-parallel ranks share the global batch (not the world size under
        tensor parallelism)."""
        return self.topology.dp_degree

    @property
    def dp_rank(self) -> int:
        return self.topology.dp_rank()

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
        # Several data-parallel ranks and a bare model: compared across ranks before the
        # first save (``registration``).
        if self.topology.dp_degree > 1 and not distributed(model):
            self._replicas = ReplicaCheck(model, self.groups.ckpt, self.world_size)
        self._registered = [scheduler, *extra.values()]
        check_schedulers(optimizer, self._registered)
        if scaler is not None:
            self.scaler = scaler
        self.model, self.optimizer = model, optimizer
        self._buffers = BufferSync.of(model, self.topology.dp_degree)
        self._state = build_state(model, optimizer, self._train, scheduler=scheduler,
                                  scaler=self.scaler, extra=extra)

    def resume(self, before_saying: Callable[[], None] | None = None) -> int:
        """Restore the newest snapshot every rank holds in memory, else load the newest
        complete, verified checkpoint (every rank); the step it holds (``runtime.resume``).
        ``before_saying`` (``steps``: binding the data to the restored position) runs before the
        ``resume`` event, so a checkpoint the data cannot continue is refused before "resumed from"."""
        if self._resumed:
            return self._train.step
        if self._state is None:
            raise UsageError("run.resume()/run.steps() before run.register()",
                             "call run.register(model, optimizer, ...) first")
        check_schedulers(self.optimizer, self._registered)  # one built after register()
        self._resumed = True
        found = restore(self._state, self.model, topology=self.topology, memory=self.memory, ckpt=self.ckpt)
        self._resumed_at = found.step if found is not None else 0
        short = short_schedule(self._registered, self._train.step, self.spec.train.steps)
        if short is not None:  # before "resumed from": it would raise past its total every restart
            raise short_schedule_error(short, self._train.step, self.spec.train.steps)
        return announce(found, self._train, seed=self.spec.train.seed, events=self.events,
                        metrics=self.metrics, world_size=self.world_size, before_saying=before_saying)

    # ----- the loop --------------------------------------------------------------------
    def steps(self, dataset: Any, *, collate_fn: Callable | None = None) -> Iterator[Step]:
        """One ``Step`` per remaining update of ``train.steps`` (see ``runtime.step``; each
        ``step.done()`` runs ``runtime.hook``).

        ``dataset``: a map-style dataset (``len`` and ``[i]``) or a sharded stream (a
        ``elastic_harness.data.Stream``, a Hugging Face streaming dataset, an
        ``IterableDataset`` with ``shards`` and ``open_shard``; ``data.adapters``).

        One loop runs the whole job (every epoch). Called again after the script left a loop
        early (a ``break`` after ``step.done()``), it continues with the next step, from the
        same data position; after the job's last step, or from inside a loop body, it raises
        ``UsageError`` (docs/your-script.md)."""
        self._check_new_loop()
        self._loop = self._run_loop(dataset, collate_fn)
        return self._loop

    def _check_new_loop(self) -> None:
        """Refuse a loop that would silently train nothing, or two loops at once; end the
        loop the script left (its loader processes stop)."""
        if self._loop_done:
            raise UsageError(
                f"run.steps() was called again after all train.steps={self.spec.train.steps} updates were "
                "done: one run.steps() loop runs the whole job, every epoch, so this one has nothing to train",
                "loop over run.steps() once (derive an epoch from step.number, docs/script-api.md); to train "
                "longer, raise train.steps and run the job again: it resumes")
        step = self._yielded
        if self._loop is not None and step is not None and not step.finished and not step.drained \
                and _suspended(self._loop):
            raise UsageError(f"run.steps() was called inside the loop body of step {step.number}",
                             "finish the step with step.done() and leave the loop before starting another")
        if self._loop is not None:
            self._loop.close()  # a loop the script left early: its loader stops here

    def _run_loop(self, dataset: Any, collate_fn: Callable | None) -> Iterator[Step]:
        spec, train, watchdog = self.spec, self._train, self.watchdog
        loader = self._bound_loader(source_of(dataset), collate_fn)
        hook = self._step_hook()
        sample_log = self._sample_log()
        self.cadence.start(train.step)
        try:
            while train.step < spec.train.steps:
                watchdog.arm()
                step = self._next_step(hook, loader, sample_log)
                self._yielded = step
                yield step
                if not step.finished:
                    raise UsageError(f"the loop body of step {step.number} did not call step.done()",
                                     "call step.done() at the end of every iteration")
                if step.drained:
                    raise SystemExit(DRAIN_EXIT)
            watchdog.disarm()
            hook.finish()
            self._loop_done = True
        except GeneratorExit:  # the script left the loop (a break): a later steps() goes on
            self._left_loop_at = train.step
            raise
        finally:
            watchdog.disarm()
            hook.close()
            loader.close()

    def _bound_loader(self, source: Any, collate_fn: Callable | None) -> StepLoader | StreamLoader:
        """Resume (if the script did not), the data checked against the restored position
        before "resumed from ..." is said, and the loader of each step's share."""
        spec, watchdog = self.spec, self.watchdog

        def bind() -> Any:
            return bind_data(source, self._train, spec, self.topology, device=self.device, collate_fn=collate_fn,
                             group=self.groups.ckpt, cache_dir=self.run_dir / "data",
                             on_progress=lambda: watchdog.arm(extra_s=spec.timeouts.process_group))

        bound: list = []
        self.resume(before_saying=lambda: bound.append(bind()))
        return bound[0] if bound else bind()  # the script called resume() itself earlier

    def _step_hook(self) -> StepHook:
        """What every ``step.done()`` runs (``runtime.hook``), built from this run's parts."""
        faults = WorkerFaults(self.spec.chaos, rank=self.rank, node=self.env.node,
                              local_rank=self.local_rank, marker_dir=self.run_dir / runfiles.CHAOS,
                              events=self.log, agent=self.env.agent_pid or os.getppid())
        covered = memory_covers_join(self.memory, self.model, self._state, topology=self.topology)
        on_failure = memory_covers_failure(self.memory, self.model, self.world_size,
                                           self.spec.checkpoint.memory_on_failure)
        return StepHook(
            self.spec, self.topology,
            Trained(self._state, self._train, self.model, self.optimizer, self.scaler, self._buffers, self._replicas),
            Keeping(self.ckpt, self.memory, self.cadence, join_in_memory=covered, on_failure=on_failure),
            Signals(lambda: self.drain.requested, lambda: self.drain.stop, self.watchdog, faults),
            Reporting(self.events, self.metrics, self.env.restart_count))

    def _next_step(self, hook: StepHook, loader: Any, sample_log: Path | None) -> Step:
        """The next step: its share of the data, its seed, and (``train.record_samples``) its
        line in the sample log, written before the step's compute, not in its hook: a step
        whose gradients were reduced then has every rank's line, even when a node dies right
        after (its peers may restore that step from memory)."""
        train = self._train
        plan, batches = loader.next_step()
        seed_everything(step_seed(self.spec.train.seed, train.step, self.rank))
        step = Step(hook, train.step + 1, plan, batches)
        if sample_log is not None:
            record_samples(sample_log, self.generation, step.number, self.rank, self.world_size, plan,
                           loader.meta, dp_rank=self.topology.dp_rank(), dp_size=self.topology.dp_degree)
        return step

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
        batches = ev.eval_batches(len(dataset), self.topology.dp_degree, self.topology.dp_rank(), size)
        model = self.model
        was_training = model.training if model is not None else False
        if model is not None:
            model.eval()
        budget = self.spec.timeouts.process_group  # each batch: one budget (a phase: runtime.timer)

        def to_here(batch: Any) -> Any:
            self.watchdog.arm(extra_s=budget)
            return to_device(batch, self.device)

        try:
            with torch.no_grad(), self.autocast(), self.watchdog.phase(budget):
                sums, count = ev.run_eval(dataset, _guarded(fn), batches, collate_fn or default_collate, to_here)
                metrics = ev.reduce_metrics(sums, count)
        finally:
            if model is not None:
                model.train(was_training)
        self.metrics.evaluation(self._train.step, metrics, time.perf_counter() - t0)
        return metrics

    def phase(self, name: str, seconds: float | None = None) -> typing.ContextManager[None]:
        """Announce work in the loop where steps stop for a while (a long evaluation of your
        own, a pause to write samples): inside the block, no step is expected for up to
        ``seconds`` (default ``timeouts.process_group``) beyond ``timeouts.step``, so the
        agent does not take this rank's silence for a peer's loss (``runtime.timer``).
        ``name`` says what it is, for you; the harness announces its own phases (saves,
        ``run.evaluate``, checkpoint loads)."""
        if not name:
            raise UsageError("run.phase() needs a name", "e.g. with run.phase('generate samples', 300):")
        return self.watchdog.phase(self.spec.timeouts.process_group if seconds is None else float(seconds))

    # ----- the end -----------------------------------------------------------------------
    def close(self) -> None:
        """Finish the in-flight save, close metrics, destroy our groups; safe to call twice."""
        if self.closed:
            return
        self.closed = True
        self._keep_on_failure()  # closed on the way down after an exception: first of all
        if self._loop is not None:
            self._loop.close()  # a loop the script left (a break): its loader stops
        self._say_unfinished()
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
        self._quiet_close = self._quiet_close or exc[0] is not None
        if isinstance(exc[1], BaseException) and not self.closed:
            self._keep_on_failure(exc[1])
        self.close()

    def _close_at_exit(self) -> None:
        self._quiet_close = True  # the interpreter is ending, perhaps on an exception
        self.close()

    def _say_unfinished(self) -> None:
        """A script that left its loop early and closed the run: say so (rank 0), so the job's
        end does not read as a failure without a reason. Not when the loop ended for a reason
        that is said elsewhere: an exception on its way through ``close`` (a script's
        ``finally``, the task loop's), or a drain or stop the agent asked for."""
        at, steps = self._left_loop_at, self.spec.train.steps
        failing = sys.exc_info()[1] is not None
        if self._quiet_close or failing or self.drain.requested or self._loop_done or at is None or at >= steps:
            return
        self.events.emit("warning", message=(
            f"the script left its run.steps() loop after step {at} of train.steps={steps} and closed the "
            f"run: the job is not finished ({steps - at} steps were not trained); running the job again "
            "continues from its last checkpoint"))

    def record_failure(self, exc: BaseException) -> None:
        """On the way down: the ``failure`` event, after keeping the last completed step in
        memory (``_keep_on_failure``)."""
        self._keep_on_failure(exc)
        failures.record(self.log, exc, rank=self.rank, step=self._train.step, node=self.env.node,
                        restart=self.env.restart_count, generation=self.generation,
                        resumed_at=self._resumed_at, kept=self._kept)

    def _keep_on_failure(self, exc: BaseException | None = None) -> None:
        """An exception ends this worker (``exc``, or the one propagating through ``close``,
        called from a script's ``finally``): keep the step the tier was armed with
        (``checkpoint.memory_on_failure``: its state untouched since), once, before anything
        closes; not for a drain's exit or a loop the script left."""
        exc = exc if exc is not None else sys.exc_info()[1]
        if self._kept is None and self.memory is not None and isinstance(exc, Exception):
            self._kept = self.memory.keep_armed()

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
        """A fresh id for this worker generation (12 hex digits), the same on every rank (for
        audits): rank 0's random 48 bits, in one tensor broadcast."""
        drawn = secrets.randbits(48) if self.rank == 0 else 0
        return f"{collective.broadcast_ints([drawn], self.groups.ckpt)[0]:012x}"

    def _announce(self, pg_init_s: float) -> None:
        env, top = self.env, self.topology
        self.log.emit("worker", rank=top.rank, local_rank=env.local_rank, group_rank=env.group_rank,
                      node=env.node, restart=env.restart_count, world_size=top.world_size)
        if not env.by_harness and env.restart_count == 0:
            self.events.emit("start", who="script", nodes=top.nodes, nproc_per_node=top.nproc_per_node,
                             run_id=env.run_id, run_dir=str(self.run_dir))
        self.events.emit("rendezvous", generation=self.generation, world_size=top.world_size,
                         restart=env.restart_count, nodes=top.nodes, pg_init_s=round(pg_init_s, 3))


def _checkpoints(spec: JobSpec, run_dir: Path, topology: Topology, group: Any, events: Any,
                 watchdog: ProgressWatchdog, key: bytes) -> CheckpointManager:
    """The job's storage checkpoints, every rank's part in them (DCP over ``group``); checkpoint
    I/O re-arms the step watchdog while bytes move (a big save or load is slow, not stuck)."""
    return CheckpointManager(
        open_storage(checkpoint_root(spec.checkpoint.dir, run_dir)), spec.checkpoint,
        rank=topology.rank, world_size=topology.world_size, group=group, events=events,
        info={"task": job_identity(spec), "parallelism": spec.parallelism, "job": spec.name},
        on_progress=lambda: watchdog.arm(extra_s=spec.timeouts.process_group),
        key=key,
        optional_keys=TrainState.OPTIONAL_KEYS,
    )


def _memory_tier(spec: JobSpec, env: WorkerEnv, topology: Topology, group: Any,
                 log: EventLog, generation: str, key: bytes) -> MemoryTier | None:
    """The in-memory tier when our agent runs this worker and the job wants it. The same on
    every rank (restoring is collective): a rank whose slots cannot be opened has none.

    Its rank and world size are processes, not data-parallel ones: every process holds its
    own slots and takes part in the restore's collectives on ``group``, and a snapshot names
    the process that wrote it (a tensor-parallel rank's state is its own)."""
    if not (env.by_harness and spec.checkpoint.memory_every > 0):
        return None
    return MemoryTier.open(env.memory, env.local_rank, rank=topology.rank, world_size=topology.world_size,
                           wire=Wire.of(group, topology.world_size),
                           warn=lambda message: log.emit("warning", message=message),
                           local_size=env.local_world_size, generation=int(generation, 16),
                           link_key=key if spec.checkpoint.memory_buddy else None,
                           link_host=local_address(env.master_addr))


def _suspended(loop: Iterator[Step]) -> bool:
    """Is ``loop`` (a generator) paused at a ``yield``, i.e. the script is in its body?"""
    import inspect

    return inspect.getgeneratorstate(loop) == inspect.GEN_SUSPENDED  # type: ignore[arg-type]


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
