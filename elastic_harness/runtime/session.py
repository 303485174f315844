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

This module is the script's API; the work behind it lives apart: ``runtime.build`` (what a
generation builds: its groups' layout and mesh, events, checkpoints, memory tier, cadence,
metrics, watchdog, step hook), ``runtime.resume`` (where a generation starts from, and the
data-position checks), ``runtime.loop`` (the loop behind ``steps``), ``runtime.hook`` (what
each ``step.done()`` does: counters, metrics, saves, snapshots, drain, faults) and
``runtime.step`` (one step's micro-batches and loss scaling).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time
import typing
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elastic_harness.data.adapters import source_of
from elastic_harness.data.sampler import DataState
from elastic_harness.errors import HarnessError, UsageError
from elastic_harness.launch.env import JOIN_SIGNAL, WorkerEnv
from elastic_harness.records.rundir import check_paths
from elastic_harness.runtime import build, failures, inplace, precision
from elastic_harness.runtime import dist as hdist
from elastic_harness.runtime import evaluate as ev
from elastic_harness.runtime.buffers import BufferSync
from elastic_harness.runtime.build import job_identity
from elastic_harness.runtime.hook import ReplicaCheck, Trained, save_due_by_steps, save_due_by_time
from elastic_harness.runtime.jobsource import resolve_job, script_flags
from elastic_harness.runtime.loader import LoaderSettings, StepLoader, StreamLoader, to_device
from elastic_harness.runtime.loop import DRAIN_EXIT, Loop, Samples
from elastic_harness.runtime.registration import (
    check_registration,
    check_schedulers,
    distributed,
    short_schedule,
    short_schedule_error,
)
from elastic_harness.runtime.repoint import RunInPlace
from elastic_harness.runtime.resume import announce, bind_data, restore
from elastic_harness.runtime.seeding import seed_everything, step_seed
from elastic_harness.runtime.state import TrainState, build_state
from elastic_harness.runtime.step import Step
from elastic_harness.runtime.topology import Topology
from elastic_harness.spec import JobSpec

__all__ = ["DRAIN_EXIT", "Run", "active", "check_registration", "init", "job_identity",
           "save_due_by_steps", "save_due_by_time", "seed_everything", "step_seed"]

_ACTIVE: Run | None = None  # the one run of this process (failure records read its step)


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
    recovery = inplace.install(spec, env)  # None: every fault restarts this worker
    t0 = time.perf_counter()
    groups = hdist.init(env, spec.device, spec.timeouts.process_group,
                        live=recovery.gens if recovery is not None else None,
                        forming=recovery.forming() if recovery is not None else None)
    pg_init_s = time.perf_counter() - t0
    try:
        claim = None if env.by_harness else _prepare_standalone(spec, run_dir, env, groups.ckpt)
    except HarnessError as e:
        hdist.destroy(groups)
        _refuse(e, env)
    _ACTIVE = Run(spec, env, groups, run_dir, pg_init_s=pg_init_s, claim=claim, topology=topology,
                  recovery=recovery)
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
    from elastic_harness.records.rundir import prepare

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

    def take_join(self) -> bool:
        """A drain for a join only (no stop), taken: the worker parks for it and goes on in the
        next generation. Taking it clears it: a worker re-pointed in place keeps this object,
        and its next step drained for the same join again (one more round, a worker restarted)."""
        if not self.requested or self.stop:
            return False
        self.requested = False
        return True

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Run:
    """One process's part of a job. Built by ``init``; see the module docstring.

    What it works with is built in one place (``runtime.build``): its generation (``gen``:
    the groups, the layout and its mesh, the generation id, the event log) and that
    generation's parts (``parts``: checkpoints, the memory tier and its cadence, metrics, the
    step watchdog). The run itself keeps what the process owns: the spec, the run directory
    and its lock, the drain, the position in the job and what the script registered; its
    loops are ``runtime.loop``'s."""

    def __init__(self, spec: JobSpec, env: WorkerEnv, groups: hdist.Groups, run_dir: Path,
                 pg_init_s: float = 0.0, claim: Any = None, topology: Topology | None = None,
                 recovery: inplace.Recovery | None = None) -> None:
        self.spec, self.env, self.run_dir = spec, env, Path(run_dir)
        self.recovery = recovery  # in-place recovery of this process (``runtime.inplace``), or None
        self.claim = claim  # the run dir's lock, held by rank 0 under plain torchrun/python
        self.argv: list[str] = []  # command-line arguments init(argv=...) did not consume
        self.closed = False
        topology = topology if topology is not None else Topology.from_env(env, spec.parallelism)
        agreed = recovery.take_agreed() if recovery is not None else None  # a rerun: shaken already
        self.gen = build.join(spec, env, groups, self.run_dir, topology, pg_init_s, agreed=agreed)
        # What a script reads: the parallel layout (runtime.topology), a mesh layout's
        # DeviceMesh, the device, and who this process is among all of them (collectives,
        # files, events; the data split, the loss scale and evaluation use the data-parallel
        # rank and degree instead).
        self.groups, self.topology, self.mesh, self.device = groups, topology, self.gen.mesh, groups.device
        self.rank, self.world_size, self.local_rank = topology.rank, topology.world_size, env.local_rank
        precision.check(spec.train.precision, self.device)
        seed_everything(spec.train.seed)  # identical initial weights on every rank and restart
        self.drain = Drain()
        self.parts = build.equip(spec, env, self.gen, self.run_dir)
        # The position is global (a stream cursor); the process count is saved for reports.
        self._train = TrainState(DataState(spec.train.seed, 0), self.world_size)
        self._trained: Trained | None = None  # what ``register`` named, as the steps train it
        self._registered: list[Any] = []  # the scheduler and extra objects register() named
        self._resumed = False
        self._resumed_at: int | None = None  # the step this attempt started from (crash loops)
        self._kept: int | None = None  # the step kept in memory on a failure (``_keep_on_failure``)
        self._loop = Loop(spec, self._train, self.parts.watchdog, self.parts.cadence, self.rank)
        self._in_place = RunInPlace(self) if recovery is not None else None  # runtime.repoint: its loop's part too
        self._quiet_close = False  # closing on the way down (an exception, the interpreter's exit)
        # Our agent's entry records escaping exceptions itself; under plain torchrun or
        # python, the interpreter's last-chance hook does. ``close`` at the interpreter's exit.
        self._previous_hook = sys.excepthook
        if not env.by_harness:
            sys.excepthook = self._excepthook
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
        if self._trained is not None:
            raise UsageError("run.register() was called twice", "register everything in one call")
        check_registration(model, optimizer, scheduler, extra)
        # Several data-parallel ranks and a bare model: compared across ranks before the
        # first save (``registration``).
        replicas = None
        if self.topology.dp_degree > 1 and not distributed(model):
            replicas = ReplicaCheck(model, self.groups.ckpt, self.world_size)
        self._registered = [scheduler, *extra.values()]
        check_schedulers(optimizer, self._registered)
        scaler = scaler if scaler is not None else precision.grad_scaler(self.spec.train.precision, self.device)
        buffers = BufferSync.of(model, self.topology.dp_degree)
        state = build_state(model, optimizer, self._train, scheduler=scheduler, scaler=scaler, extra=extra)
        self._trained = Trained(state, self._train, model, optimizer, scaler, buffers, replicas)

    def resume(self, before_saying: Callable[[], None] | None = None) -> int:
        """Restore the newest snapshot every rank holds in memory, else load the newest
        complete, verified checkpoint (every rank); the step it holds (``runtime.resume``).
        ``before_saying`` (``steps``: binding the data to the restored position) runs before the
        ``resume`` event, so a checkpoint the data cannot continue is refused before "resumed from"."""
        if self._resumed:
            return self._train.step
        trained = self._trained
        if trained is None:
            raise UsageError("run.resume()/run.steps() before run.register()",
                             "call run.register(model, optimizer, ...) first")
        check_schedulers(trained.optimizer, self._registered)  # one built after register()
        self._resumed = True
        if self._in_place is not None:  # the step in flight may be finished in place (``runtime.inflight``):
            # hooked here, not in register(), so that a script may still register its own
            # communication hook after run.register() (DDP takes one; the step is then redone)
            self._in_place.registered(trained.model)
        if self.recovery is not None:
            self.recovery.restoring()
        found = restore(trained.state, trained.model, topology=self.topology, memory=self.parts.memory,
                        ckpt=self.parts.ckpt.restorer)
        self._resumed_at = found.step if found is not None else 0
        short = short_schedule(self._registered, self._train.step, self.spec.train.steps)
        if short is not None:  # before "resumed from": it would raise past its total every restart
            raise short_schedule_error(short, self._train.step, self.spec.train.steps)
        return announce(found, self._train, seed=self.spec.train.seed, events=self.gen.events,
                        metrics=self.parts.metrics, world_size=self.world_size, before_saying=before_saying)

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
        ``UsageError`` (docs/your-script.md; ``runtime.loop``)."""
        return self._loop.start(
            lambda: self._bound_loader(source_of(dataset), collate_fn),
            lambda: build.step_hook(self.spec, self.env, self.run_dir, self.gen, self.parts, self._trained,
                                    self.drain, in_place=self._in_place),
            lambda: Samples.of(self.spec, self.run_dir, self.gen.id, self.topology))

    def _bound_loader(self, source: Any, collate_fn: Callable | None) -> StepLoader | StreamLoader:
        """Resume (if the script did not), the data checked against the restored position
        before "resumed from ..." is said, and the loader of each step's share."""
        spec, watchdog = self.spec, self.parts.watchdog

        def bind() -> Any:
            settings = LoaderSettings.of(spec, self.device, collate_fn)
            return bind_data(source, self._train, spec, self.topology, settings, group=self.groups.ckpt,
                             cache_dir=self.run_dir / "data",
                             on_progress=lambda: watchdog.arm(extra_s=spec.timeouts.process_group))

        bound: list = []
        self.resume(before_saying=lambda: bound.append(bind()))
        return bound[0] if bound else bind()  # the script called resume() itself earlier

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
        model = self._trained.model if self._trained is not None else None
        was_training = model.training if model is not None else False
        if model is not None:
            model.eval()
        budget, watchdog = self.spec.timeouts.process_group, self.parts.watchdog  # each batch: one budget

        def to_here(batch: Any) -> Any:
            watchdog.arm(extra_s=budget)
            return to_device(batch, self.device)

        try:
            with torch.no_grad(), self.autocast(), watchdog.phase(budget):
                sums, count = ev.run_eval(dataset, _guarded(fn), batches, collate_fn or default_collate, to_here)
                metrics = ev.reduce_metrics(sums, count)
        finally:
            if model is not None:
                model.train(was_training)
        self.parts.metrics.evaluation(self._train.step, metrics, time.perf_counter() - t0)
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
        return self.parts.watchdog.phase(self.spec.timeouts.process_group if seconds is None else float(seconds))

    # ----- the end -----------------------------------------------------------------------
    def close(self) -> None:
        """Finish the in-flight save, close metrics, destroy our groups; safe to call twice."""
        if self.closed:
            return
        self.closed = True
        self._keep_on_failure()  # closed on the way down after an exception: first of all
        self._loop.close()  # a loop the script left (a break): its loader stops
        unfinished = self._loop.unfinished(quiet=self._quiet_close, drain_requested=self.drain.requested)
        if unfinished:  # a script that left its loop early: said, so its end is not a silent failure
            self.gen.events.emit("warning", message=unfinished)
        try:
            self.parts.ckpt.saver.close()
            self.parts.metrics.close()
            if self.parts.memory is not None:
                self.parts.memory.close()
        finally:
            self.drain.restore()
            sys.excepthook = self._previous_hook
            if self._in_place is None or not self._in_place.reruns():
                if self.recovery is not None:
                    self.recovery.finish()
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

    def record_failure(self, exc: BaseException) -> None:
        """On the way down: the ``failure`` event, after keeping the last completed step in
        memory (``_keep_on_failure``)."""
        self._keep_on_failure(exc)
        who = failures.Who(self.rank, self.env.node, self.env.restart_count, self.gen.id)
        failures.record(self.gen.log, exc, who, step=self._train.step, resumed_at=self._resumed_at,
                        kept=self._kept)

    def _keep_on_failure(self, exc: BaseException | None = None) -> None:
        """An exception ends this worker (``exc``, or the one propagating through ``close``,
        called from a script's ``finally``): keep the step the tier was armed with
        (``checkpoint.memory_on_failure``: its state untouched since), once, before anything
        closes; not for a drain's exit or a loop the script left."""
        exc = exc if exc is not None else sys.exc_info()[1]
        memory = self.parts.memory
        if self._kept is None and memory is not None and isinstance(exc, Exception):
            self._kept = memory.keep_armed()

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
