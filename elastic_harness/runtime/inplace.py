"""In-place recovery, the worker's part: a survivor of a fault keeps its process.

When a collective of this worker's generation fails (a peer died: its connections reset) or
the agent says ``leave`` (a peer failed elsewhere, a frozen node was dropped), the groups
leave the generation (``runtime.generations``: nothing blocks, nothing raises in the training
code) and the step is thrown away at the next harness call. The worker then:

1. **parks** (``park``): tells its agent the step it rolls back to and waits for its place
   in the next generation (a ``reform`` order: torchelastic's variables, as a new worker
   would be started with; ``runtime.control``). The step watchdog is off meanwhile.
2. **re-forms** (``reform``): the generation's store (the new rank 0 serves it, ``runtime.dist``),
   its groups over every rank re-formed there at the new rank and size, and the
   generation's handshake (``Handshake``: one all-gather of every rank's pid and whether it
   is new to the job's processes, with rank 0's id for the generation; new workers make the
   same call when they start, ``runtime.build.join``).
3. **goes on** in one of two ways, the same on every survivor (``how``):
   - ``repoint``: every member of the new generation is a survivor (a node lost or removed,
     nobody replacing it), the layout is DDP and no mesh was built: the run re-points its
     parts at the new generation (``Run.reform``: the DDP model at the resized group, the
     checkpoints, the memory tier, the data split), restores the newest step every rank
     holds from memory and continues its loop;
   - ``rerun``: a new worker joins (a crashed worker's replacement, a spare, a new node) or
     the layout's objects are built for another membership (FSDP, a mesh): the training
     function runs again from its top in this process (``Rerun`` unwinds it; the entry runs
     it again), as the new workers run it, and restores from memory: whatever the new workers
     build collectively (DDP's and DTensor's initial broadcasts, a mesh's groups), the
     survivors build with them.

Anything that fails on the way (no order within the bound, the agent gone, a second fault
while re-forming, a restore that throws) ends this process as a failure, and the agent
starts a new worker in its place (today's warm restart, for this rank).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from elastic_harness.launch.env import WORKER_VARS, WorkerEnv
from elastic_harness.runtime import generations
from elastic_harness.runtime.control import Control

REPOINT, RERUN, FINISH = "repoint", "rerun", "finish"
# Tests force each way the in-place path can fail, once per process (docs/in-place.md):
# "KIND:RANK" with KIND one of ``FORCED`` and RANK the rank that fails (in the generation that broke);
# "told:RANK@STEP": that rank starts step STEP's micro-batches only once its agent's word of a loss
# came (``late_for_word``), so its node's collectives of the step run after the word.
FAULT_VAR = "ELASTIC_HARNESS_INPLACE_FAULT"
FORCED = ("silent", "reform", "restore", "die", "finish", "told")
WORD_BOUND_S = 60.0  # how long the forced ``told`` waits for the word
REFORM_FAILED_EXIT = 75  # a second fault came while this worker re-formed: it starts anew

class Rerun(BaseException):
    """Unwinds the training function so that it runs again in this process (``entry``).
    A ``BaseException``: a script's ``except Exception`` does not stop it on its way."""


class Parked(RuntimeError):
    """No next place came for this process (the agent gone, no order within the bound, or
    told to exit): it ends, and the agent starts another in its place."""


@dataclass(frozen=True)
class Handshake:
    """What every rank of a generation learns at its start, in one all-gather."""

    id: str  # the generation's id: rank 0's 48 random bits, 12 hex digits
    pids: tuple[int, ...]  # every rank's process id, by rank
    new: tuple[bool, ...]  # by rank: a process that started for this generation (not a survivor)
    # by rank: a survivor's data-parallel rank and degree in the generation it left (-1, 0: new)
    old_dp: tuple[tuple[int, int], ...] = ()
    # by rank: the step a survivor would finish in place (``runtime.inflight``), -1: none
    finishing: tuple[int, ...] = ()

    @property
    def newcomers(self) -> int:
        return sum(self.new)

    @property
    def kept(self) -> tuple[int, ...]:
        return tuple(pid for pid, new in zip(self.pids, self.new, strict=True) if not new)

    def finishes(self, step: int) -> bool:
        """Is every rank a survivor that would finish ``step`` in place, from one generation?"""
        return (step >= 0 and bool(self.finishing) and all(f == step for f in self.finishing)
                and len({w for _, w in self.old_dp}) == 1)


def shake(group: Any, rank: int, world_size: int, *, new: bool, old_dp: tuple[int, int] = (-1, 0),
          finishing: int = -1) -> Handshake:
    """Collective over ``group`` (every rank): the generation's ``Handshake``, in one all-gather."""
    import secrets

    mine = torch.tensor([os.getpid(), int(new), secrets.randbits(48) if rank == 0 else 0, *old_dp, finishing],
                        dtype=torch.int64)
    out = [torch.zeros(6, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(out, mine, group=group)
    rows = [t.tolist() for t in out]
    return Handshake(f"{rows[0][2]:012x}", tuple(r[0] for r in rows), tuple(bool(r[1]) for r in rows),
                     tuple((r[3], r[4]) for r in rows), tuple(r[5] for r in rows))


def how(handshake: Handshake, parallelism: Any) -> str:
    """Pure: how the survivors go on (module doc): ``repoint`` only when nobody is new and
    the layout is DDP (which builds no mesh); else ``rerun``."""
    return REPOINT if handshake.newcomers == 0 and parallelism == "ddp" else RERUN


def worker_vars(env: Mapping[str, str]) -> dict[str, str]:
    """Pure: the reform order's variables this process takes (``launch.env.WORKER_VARS``)."""
    return {k: str(v) for k, v in env.items() if k in WORKER_VARS}


@dataclass
class Recovery:
    """This process's in-place recovery: its control line and its live groups."""

    control: Control
    gens: generations.Generations
    bound_s: float  # how long a parked worker waits for its next place
    survivor: bool = False  # this process has been through a re-formation
    agreed: Handshake | None = None  # the handshake of a re-formation, for the rerun's ``join``
    phases: dict[str, float] = field(default_factory=dict)  # the last fault's, in seconds
    forced: str = ""  # a failure of the in-place path a test forces on this rank (``FAULT_VAR``)
    forced_at: int | None = None  # the step it is forced at, where it names one
    underway: bool = False  # parked for a fault and not re-formed yet: a failure now ends the process
    pending: Any = None  # a step in flight to finish once the training function runs again (``runtime.repoint``)
    # the groups within this node a word of another node's loss leaves running for now (HSDP: its
    # shard group while the step's backward is under way, ``inflight.KeptShards.holding``)
    holding: Callable[[], tuple] = lambda: ()
    _since: float = 0.0
    _reforming: bool = False
    _telling: threading.Lock = field(default_factory=threading.Lock)  # ``broken`` vs ``parked``: one order

    def start(self) -> Recovery:
        self.control.on_leave = self._left
        self.gens.on_broken = self._broke
        self.control.start()
        self.control.tell("live")  # the agent keeps this worker's process through a fault
        return self

    def _left(self, reason: str, remote: bool = False) -> None:  # the control line's thread
        """The agent's word: leave the step. Another node's loss (``remote``) leaves the groups
        this node's step still needs running (``holding``): their members are all alive, and a
        reduce-scatter cut short would spoil the gradients the survivors finish the step with."""
        if self._reforming:  # a fault while the groups form: a connect in flight cannot be left
            _say(f"a fault while this worker's groups form ({reason}); it ends and starts anew")
            os._exit(REFORM_FAILED_EXIT)
        self._mark()
        _say(f"leaving the step: {reason}")
        spare = self.holding() if remote else ()
        self.gens.leave(reason, spare=spare)
        if spare and not self.holding():  # the node got past its backward meanwhile
            self.gens.leave(reason)

    def _broke(self, reason: str) -> None:  # a backend's thread: a collective failed here
        """Told before the groups are left: leaving lets the training thread park, and the
        agent must hear ``broken`` before ``parked`` (after it, the word would reach the agent
        once the next group started, and break that group). Not told once parked: the fault
        is being handled."""
        self._mark()
        _say(f"a collective failed ({reason[:300]}); leaving the step")
        with self._telling:
            if not self.underway:
                self.control.tell("broken", reason=reason[:500])
        self.gens.leave(reason)  # our peers blocked on us see our connections close now

    def _mark(self) -> None:
        if not self._since:
            self._since = time.monotonic()

    def broken(self) -> str | None:
        return self.gens.broken

    def finish(self) -> None:
        """The job's work in this process is done (its run closed): what fails from now on
        (peers ending their groups) is no fault to recover."""
        self.gens.on_broken = lambda reason: None
        self.control.on_leave = lambda reason, remote: None

    def park(self, step: int, kept: int | None) -> dict[str, str]:
        """Tell the agent this rank left its step and rolls back to ``step`` (``kept``: the
        step it kept in memory on the way, if any), or finishes the next in place; wait for
        the next place (its variables)."""
        t0 = time.monotonic()
        with self._telling:  # a ``broken`` told from now on would come after ``parked``
            self.underway = True
        self.phases = {"leave": round(t0 - (self._since or t0), 4)}
        if self.force("silent"):  # never says it parked: the agent's bound ends it
            while True:
                time.sleep(3600)
        self.control.tell("parked", step=step, kept=kept)
        order = self.control.await_order(self.bound_s)
        self.phases["park"] = round(time.monotonic() - t0, 4)
        if order.get("op") != "reform" or not isinstance(order.get("env"), dict):
            raise Parked({"timeout": f"no place in a next generation within {self.bound_s:.0f} s",
                          "closed": "the agent is gone", "exit": "the agent chose to start a new worker"}
                         .get(order.get("op", ""), "unexpected order"))
        return worker_vars(order["env"])

    def reform(self, variables: dict[str, str], spec: Any, old_dp: tuple[int, int] = (-1, 0),
               finishing: int = -1) -> tuple[WorkerEnv, Handshake]:
        """Take the new place: the environment, the store, the groups over every rank, the
        handshake (collective, with the generation's new workers: ``old_dp``, this rank's
        data-parallel rank and degree in the generation it left, and ``finishing``, the step it
        would finish in place or -1); its ``reformed`` event."""
        from pathlib import Path

        from elastic_harness import runfiles
        from elastic_harness.events import EventLog
        from elastic_harness.runtime import dist as hdist

        t0 = time.monotonic()
        os.environ.update(variables)
        env = WorkerEnv.from_environ()
        if self.force("reform"):
            raise RuntimeError("re-forming failed (forced by ELASTIC_HARNESS_INPLACE_FAULT)")
        self._reforming = True
        try:
            store = hdist.generation_store(env, spec.timeouts.process_group)
            self.gens.reform(store, env.rank, env.world_size, generations.tag_of(env.master_port))
            if self.force("die"):
                os._exit(REFORM_FAILED_EXIT)  # a second fault in the middle of the re-formation
            self.agreed = shake(hdist.current().ckpt, env.rank, env.world_size, new=False, old_dp=old_dp,
                                finishing=finishing)
        finally:
            self._reforming = False
        self.survivor, self.underway = True, False
        self.phases["reform"] = round(time.monotonic() - t0, 4)
        self._since = 0.0
        if env.run_dir:
            mode = FINISH if self.agreed.finishes(finishing) else how(self.agreed, spec.parallelism)
            EventLog(Path(env.run_dir) / runfiles.EVENTS).emit("reformed", rank=env.rank, mode=mode,
                                                               phases_s=dict(self.phases))
        return env, self.agreed

    @contextlib.contextmanager
    def forming(self) -> Iterator[None]:
        """A new worker makes its groups (``runtime.dist``): told to leave meanwhile, it ends
        (gloo's connect cannot be left, and a new worker has nothing to keep)."""
        self._reforming = True
        try:
            yield
        finally:
            self._reforming = False

    def restoring(self) -> None:
        """A survivor's restore begins (``Run.resume``): where a test forces it to throw."""
        if self.survivor and self.force("restore"):
            raise RuntimeError("restoring in place failed (forced by ELASTIC_HARNESS_INPLACE_FAULT)")

    def force(self, kind: str) -> bool:
        """Does the test's forced failure (``FAULT_VAR``) fire here, now (once)?"""
        if self.forced != kind:
            return False
        self.forced = ""
        _say(f"forced failure of the in-place path: {kind}")
        return True

    def late_for_word(self, step: int) -> None:
        """The forced ``told`` (a test's): before ``step``'s micro-batches, wait for the agent's
        word of a loss (at most ``WORD_BOUND_S``)."""
        if self.forced_at != step or not self.force("told"):
            return
        deadline = time.monotonic() + WORD_BOUND_S
        while self.control.left is None and time.monotonic() < deadline:
            time.sleep(0.005)

    def take_agreed(self) -> Handshake | None:
        """The handshake a re-formation made, once (the rerun's ``join`` uses it instead of
        shaking again: the new workers shook once)."""
        agreed, self.agreed = self.agreed, None
        return agreed


def _say(line: str) -> None:
    """One line in this worker's log (any thread)."""
    import sys

    print(f"[in place, pid {os.getpid()}] {line}", file=sys.stderr, flush=True)


_RECOVERY: Recovery | None = None


def install(spec: Any, env: WorkerEnv) -> Recovery | None:
    """This process's ``Recovery`` when in place is possible: our agent started it with a
    control line, the job's ``recovery`` is ``in_place`` and torch has what live groups
    need (``torchcompat.groups``' probe); None otherwise (every fault restarts the worker)."""
    global _RECOVERY
    if _RECOVERY is not None:
        return _RECOVERY
    from elastic_harness.torchcompat.probe import on

    if not env.by_harness or spec.recovery != "in_place" or not on("live-groups"):
        return None
    control = Control.from_environ(os.environ)
    if control is None:
        return None
    gens = generations.install(rank=env.rank, world_size=env.world_size, timeout_s=spec.timeouts.process_group)
    bound = max(float(spec.timeouts.process_group), float(spec.rendezvous.join_timeout))
    forced, at = forced_here(os.environ.get(FAULT_VAR, ""), env.rank)
    _RECOVERY = Recovery(control, gens, bound, forced=forced, forced_at=at).start()
    return _RECOVERY


def forced_here(value: str, rank: int) -> tuple[str, int | None]:
    """Pure: the forced failure (``FAULT_VAR``: "KIND:RANK" or "KIND:RANK@STEP") for this rank
    and its step, or ("", None)."""
    kind, _, who = value.partition(":")
    who, _, at = who.partition("@")
    if kind not in FORCED or not who.isdigit() or int(who) != rank or (at and not at.isdigit()):
        return "", None
    return kind, int(at) if at else None


def current() -> Recovery | None:
    return _RECOVERY
