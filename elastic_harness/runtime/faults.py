"""Worker-side fault injection, keyed by (rank or node, step): deterministic chaos.

Which faults a worker fires, and how, is ``chaos.vocabulary``'s: step-keyed faults on
training processes fire here, inside the process they hit, right after that step completes
(a host watching events would see the step late). Each fault fires once per run directory:
the first process to claim ``RUN_DIR/chaos/fault-I`` (``O_EXCL``) fires it, so a restart
that replays the step does not fire it again. Node faults are fired by the node's local
rank 0 against its own agent, so only processes of this job are signalled. The agent's pid
is given (``agent``): a warm-started worker's parent is its agent's zygote, not the agent.

Call order: construct once per worker process, then ``after_step(step)`` after every
completed optimizer step (after any save of that step).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
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
                pid, whom = recipient(f, os.getpid(), self.agent)
                kind = KINDS[f.kind]
                self.events.emit("fault", kind=f.kind, target=f.target, step=step, rank=self.rank,
                                 node=self.node, detail=f"{kind.signal.name} {whom} (pid {pid})")
                os.kill(pid, kind.signal)

    def _claim(self, i: int) -> bool:
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        try:
            os.close(os.open(self.marker_dir / runfiles.fault_marker(i), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False


def recipient(f: FaultSpec, pid: int, parent: int) -> tuple[int, str]:
    """Pure: the process a worker signals for ``f`` and how to name it in the event.

    A rank fault hits the worker itself; a node fault its agent (``parent``). For
    ``kill-node`` the workers follow the agent through ``PR_SET_PDEATHSIG``.
    """
    if KINDS[f.kind].target == "rank":
        return pid, f"rank {f.target}"
    return parent, f"node {f.target}'s agent"
