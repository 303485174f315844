"""Worker-side fault injection, keyed by (rank or node, step): deterministic chaos.

Which faults a worker fires, and how, is ``chaos.vocabulary``'s: step-keyed faults on
training processes fire here, inside the process they hit, right after that step completes
(a host watching events would see the step late). Each fault fires once per run directory:
the first process to claim ``RUN_DIR/chaos/fault-I`` (``O_EXCL``) fires it, so a restart
that replays the step does not fire it again. Node faults are fired by the node's local
rank 0 against its own agent, so only processes of this job are signalled. The agent's pid
is given (``agent``): a warm-started worker's parent is its agent's zygote, not the agent.
A node kill ends the agent, every process under it and the firing worker at once
(``node_processes``), as a machine that dies does.

Call order: construct once per worker process, then ``after_step(step)`` after every
completed optimizer step (after any save of that step). A fault with ``during`` (a step's
``backward`` or ``reduction``) is armed by ``after_step`` of the step it names and fires at
``fire_armed(phase)`` of the next step: ``runtime.step`` (the last micro-batch's backward) and
the local-gradient hook (``runtime.inflight``, the reduction) call it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from elastic_harness import runfiles
from elastic_harness.chaos.schedule import hits
from elastic_harness.chaos.vocabulary import KINDS
from elastic_harness.spec import FaultSpec


class WorkerFaults:
    def __init__(self, faults: Sequence[FaultSpec], *, rank: int, node: str, local_rank: int,
                 marker_dir: Path, events, agent: int) -> None:
        self.faults = list(faults)
        self.rank, self.node, self.local_rank, self.agent = rank, node, local_rank, agent
        self.marker_dir, self.events = marker_dir, events

    def after_step(self, step: int) -> None:
        for i, f in enumerate(self.faults):
            if hits(f, step, self.rank, self.node, self.local_rank) and self._claim(i):
                if f.during:  # the next step's backward or reduction fires it
                    _ARMED[f.during] = (self, f, step)
                    continue
                self.fire(f, step)

    def fire(self, f: FaultSpec, step: int) -> None:
        """Fire ``f``, keyed to ``step``, now (the signal, to whom its kind says)."""
        pid, whom = recipient(f, os.getpid(), self.agent)
        kind = KINDS[f.kind]
        ends = [pid]
        if kind.reaches == "agent-group":  # the whole node at once, as a dead machine
            ends = node_processes(pid, os.getpid(), children_of if own_proc() else lambda _: [])
            whom += " and its workers" if len(ends) > 2 else ""
        during = f" during step {step + 1}'s {f.during}" if f.during else ""
        self.events.emit("fault", kind=f.kind, target=f.target, step=step, rank=self.rank,
                         node=self.node, detail=f"{kind.signal.name} {whom} (pid {pid}){during}")
        end_all(ends, kind.signal)

    def _claim(self, i: int) -> bool:
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        try:
            os.close(os.open(self.marker_dir / runfiles.fault_marker(i), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False


# Faults armed to fire during the next step's "backward" or "reduction" (``after_step``).
_ARMED: dict[str, tuple[WorkerFaults, FaultSpec, int]] = {}


def fire_armed(phase: str) -> None:
    """Fire the fault armed for ``phase`` of this step, if any (once)."""
    armed = _ARMED.pop(phase, None)
    if armed is not None:
        faults, f, step = armed
        faults.fire(f, step)


def node_processes(agent: int, me: int, children: Callable[[int], list[int]]) -> list[int]:
    """Pure: the processes a node fault ends, in order: the agent, its descendants (a warm
    start's zygote and the zygote's workers, or the workers of a cold start), this worker last.

    Before this, only the agent was signalled and its workers followed through
    ``PR_SET_PDEATHSIG``, one parent's exit at a time (agent, zygote, worker): the "dead"
    node's worker trained on for 40-60 ms after its fault event (7 more steps of a 2-node
    bench job), and every recovery time counted from that event included them."""
    order, seen, queue = [agent], {agent, me}, [agent]
    while queue:
        for child in children(queue.pop(0)):
            if child not in seen:
                seen.add(child)
                order.append(child)
                queue.append(child)
    return [*order, me]


def children_of(pid: int) -> list[int]:
    """The children of ``pid`` as the kernel lists them (``/proc/PID/task/TID/children``);
    none if it is gone or the kernel does not list them (its workers then follow through
    ``PR_SET_PDEATHSIG``, later)."""
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(c) for c in f.read().split())
    except (OSError, ValueError):
        pass
    return out


def own_proc() -> bool:
    """Does ``/proc`` number processes as this process does? Not in a pid namespace that
    kept the machine's ``/proc``: its pids would name other processes there."""
    try:
        return os.readlink("/proc/self") == str(os.getpid())
    except OSError:
        return False


def end_all(pids: Sequence[int], sig: int) -> None:
    """Signal each of ``pids`` in order; one already gone is skipped."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def recipient(f: FaultSpec, pid: int, parent: int) -> tuple[int, str]:
    """Pure: the process a worker signals for ``f`` and how to name it in the event.

    A rank fault hits the worker itself; a node fault its agent (``parent``). For
    ``kill-node`` the workers follow the agent through ``PR_SET_PDEATHSIG``.
    """
    if KINDS[f.kind].target == "rank":
        return pid, f"rank {f.target}"
    return parent, f"node {f.target}'s agent"
