"""The loop behind ``run.steps()``: one ``Step`` per remaining update of the job.

One loop runs the whole job (every epoch). A script may leave it early (a ``break`` after
``step.done()``) and call ``run.steps()`` again: the next loop continues with the next step,
from the same data position. ``Loop`` keeps what that needs across calls: the open loop, the
step it yielded last, whether the job's last step was done in this process and where the
script left a loop. Call order: ``start`` per ``run.steps()``; ``close`` from ``run.close``.

Each loop, on its first step, binds the data (after resuming, ``Run``'s part) and builds the
step hook; every step then re-arms the step watchdog, seeds the step's randomness, writes its
sample record (``train.record_samples``) and hands the script its ``Step``. After the last step
it runs the hook's ``finish`` (the final save, the digest, the ``finish`` event); after a drain,
``SystemExit(DRAIN_EXIT)``.

In place (``in_place``: the run's in-place recovery, ``runtime.inplace``): a step whose
generation broke is thrown away (the hook counted nothing of it, ``Step.thrown``), and so is a
loop about to start a step on a broken generation; the run's ``recover`` then parks and
re-forms, and the loop binds the data again (a resume first) and builds its hook anew for the
next generation, or the recovery unwinds the training function (``Rerun``).
"""

from __future__ import annotations

import inspect
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic_harness import runfiles
from elastic_harness.errors import UsageError
from elastic_harness.memtier.cadence import Cadence
from elastic_harness.runtime.audit import Writer, record_samples
from elastic_harness.runtime.hook import StepHook
from elastic_harness.runtime.seeding import seed_everything, step_seed
from elastic_harness.runtime.state import TrainState
from elastic_harness.runtime.step import Step
from elastic_harness.runtime.timer import ProgressWatchdog
from elastic_harness.runtime.topology import Topology
from elastic_harness.spec import JobSpec

DRAIN_EXIT = 128 + signal.SIGTERM


@dataclass(frozen=True)
class Samples:
    """Where this rank writes its sample records (``train.record_samples``) and what each
    names besides the step: the generation and this rank's place in the layout."""

    path: Path
    generation: str
    topology: Topology

    @classmethod
    def of(cls, spec: JobSpec, run_dir: Path, generation: str, topology: Topology) -> Samples | None:
        if not spec.train.record_samples:
            return None
        (run_dir / runfiles.SAMPLES).mkdir(exist_ok=True)
        return cls(run_dir / runfiles.SAMPLES / f"rank-{topology.rank}.jsonl", generation, topology)

    def record(self, step: Step, meta: Any) -> None:
        top = self.topology
        writer = Writer(self.generation, top.rank, top.world_size, top.dp_rank(), top.dp_degree)
        record_samples(self.path, writer, step.number, step.plan, meta)


class Loop:
    """The script's ``run.steps()`` loops over one job (the module docstring)."""

    def __init__(self, spec: JobSpec, train: TrainState, watchdog: ProgressWatchdog, cadence: Cadence,
                 rank: int) -> None:
        self.spec, self.train, self.watchdog, self.cadence, self.rank = spec, train, watchdog, cadence, rank
        self.current: Iterator[Step] | None = None  # the open loop
        self.yielded: Step | None = None  # the step it yielded last
        self.done = False  # the job's last step was done in this process
        self.left_at: int | None = None  # the step after which the script left a loop (a break)
        self.loader: Any = None  # the open loop's loader (a step finished in place reads from it)
        self._broken: Callable[[], bool] = lambda: False
        self._recover: Callable[[], None] | None = None
        self._joinable: Callable[[], bool] = lambda: False
        self._opening: Callable[[StepHook, Any], Step | None] = lambda hook, loader: None

    def in_place(self, broken: Callable[[], bool], recover: Callable[[], None],
                 joinable: Callable[[], bool] = lambda: False,
                 opening: Callable[[StepHook, Any], Step | None] = lambda hook, loader: None) -> None:
        """A fault may be recovered in place: ``broken()`` says the generation broke,
        ``recover()`` parks and re-forms (or raises ``Rerun``); ``joinable()`` takes a drain
        the agent asked for a joining node (True once per drain): it is waited out parked, in
        place, not by exiting;
        ``opening(hook, loader)``: the step a loop starts with instead of its next one (a step
        in flight finished after the training function ran again), or None."""
        self._broken, self._recover, self._joinable, self._opening = broken, recover, joinable, opening

    def rebind(self, watchdog: ProgressWatchdog, cadence: Cadence, rank: int) -> None:
        """The parts of the generation a recovery in place made."""
        self.watchdog, self.cadence, self.rank = watchdog, cadence, rank

    def start(self, bind: Callable[[], Any], hook: Callable[[], StepHook], samples: Callable[[], Samples | None]
              ) -> Iterator[Step]:
        """A new loop: ``bind()`` resumes and returns the loader of each step's share, ``hook()``
        what every ``step.done()`` runs, ``samples()`` where sample records go (None: nowhere);
        all three are called on the loop's first step, in that order."""
        self._check_new()
        self.current = self._run(bind, hook, samples)
        return self.current

    def close(self) -> None:
        """End the open loop (a loop the script left: its loader processes stop)."""
        if self.current is not None:
            self.current.close()

    def unfinished(self, *, quiet: bool, drain_requested: bool) -> str | None:
        """At ``run.close``: the warning a script that left its loop early is owed (the job is
        not finished, and its end must not read as a failure without a reason), or None. Not
        when the loop ended for a reason said elsewhere: closing on the way down (``quiet``),
        an exception on its way through ``close`` (a script's ``finally``, the task loop's),
        or a drain or stop the agent asked for."""
        at, steps = self.left_at, self.spec.train.steps
        failing = sys.exc_info()[1] is not None
        if quiet or failing or drain_requested or self.done or at is None or at >= steps:
            return None
        return (f"the script left its run.steps() loop after step {at} of train.steps={steps} and closed the "
                f"run: the job is not finished ({steps - at} steps were not trained); running the job again "
                "continues from its last checkpoint")

    def _check_new(self) -> None:
        """Refuse a loop that would silently train nothing, or two loops at once; end the
        loop the script left (its loader processes stop)."""
        if self.done:
            raise UsageError(
                f"run.steps() was called again after all train.steps={self.spec.train.steps} updates were "
                "done: one run.steps() loop runs the whole job, every epoch, so this one has nothing to train",
                "loop over run.steps() once (derive an epoch from step.number, docs/script-api.md); to train "
                "longer, raise train.steps and run the job again: it resumes")
        step = self.yielded
        if self.current is not None and step is not None and not step.finished and not step.drained \
                and _suspended(self.current):
            raise UsageError(f"run.steps() was called inside the loop body of step {step.number}",
                             "finish the step with step.done() and leave the loop before starting another")
        self.close()

    def _run(self, bind: Callable[[], Any], hook_of: Callable[[], StepHook],
             samples_of: Callable[[], Samples | None]) -> Iterator[Step]:
        spec, train = self.spec, self.train
        loader = self.loader = bind()
        hook = hook_of()
        samples = samples_of()
        self.cadence.start(train.step)
        try:
            while train.step < spec.train.steps:
                if self._recover is not None and self._broken():
                    hook.close()
                    loader.close()
                    self._recover()  # parked, re-formed here (or a Rerun unwinds the function)
                    loader, hook, samples = self._rebound(bind, hook_of(), samples_of)
                    continue
                self.watchdog.arm()
                step = self._opening(hook, loader) or self._next_step(hook, loader, samples)
                self.yielded = step
                yield step
                todo = self._after(step)
                if todo:
                    hook.close()
                    loader.close()
                    if todo == "recover":
                        self._recover()  # a node joins: parked at this step's end, re-formed with it
                    loader, hook, samples = self._rebound(bind, step.hook if todo == "own" else hook_of(), samples_of)
            self.watchdog.disarm()
            hook.finish()
            self.done = True
        except GeneratorExit:  # the script left the loop (a break): a later steps() goes on
            self.left_at = train.step
            raise
        finally:
            self.watchdog.disarm()
            hook.close()
            loader.close()

    def _after(self, step: Step) -> str:
        """What the loop does after ``step``: "" go on; "recover" (a drain for a node that
        joins, in place: park at this step's end and re-form with it); "own" (re-formed under
        the step, which finished in place: go on with its new hook); "new" (re-formed under
        the step, thrown away: a new hook). A drain otherwise ends the worker."""
        if not step.finished:
            raise UsageError(f"the loop body of step {step.number} did not call step.done()",
                             "call step.done() at the end of every iteration")
        if step.drained:
            if self._recover is not None and self._joinable():
                return "recover"
            raise SystemExit(DRAIN_EXIT)
        if step.reformed:
            return "own"
        return "new" if step.thrown and not self._broken() else ""

    def _rebound(self, bind: Callable[[], Any], hook: StepHook, samples_of: Callable[[], Samples | None]
                 ) -> tuple[Any, StepHook, Samples | None]:
        """The loop's parts in a generation re-formed in place: the data bound at its split
        (after a restore, unless the step was finished in place), its hook, its sample log."""
        loader = self.loader = bind()
        self.cadence.start(self.train.step)
        return loader, hook, samples_of()

    def _next_step(self, hook: StepHook, loader: Any, samples: Samples | None) -> Step:
        """The next step: its share of the data, its seed, and (``train.record_samples``) its
        line in the sample log, written before the step's compute, not in its hook: a step
        whose gradients were reduced then has every rank's line, even when a node dies right
        after (its peers may restore that step from memory)."""
        train = self.train
        plan, batches = loader.next_step()
        seed_everything(step_seed(self.spec.train.seed, train.step, self.rank))
        step = Step(hook, train.step + 1, plan, batches)
        if samples is not None:
            samples.record(step, loader.meta)
        return step


def _suspended(loop: Iterator[Step]) -> bool:
    """Is ``loop`` (a generator) paused at a ``yield``, i.e. the script is in its body?"""
    return inspect.getgeneratorstate(loop) == inspect.GEN_SUSPENDED  # type: ignore[arg-type]
