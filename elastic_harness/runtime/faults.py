"""Worker-side fault injection, keyed by (rank or node, step): deterministic chaos.

Faults that act on training processes at a step fire here, inside the process they hit,
right after that step completes (a host watching events would see the step late). Each
fault fires once per run directory: the first process to claim ``RUN_DIR/chaos/fault-I``
(``O_EXCL``) fires it, so a restart that replays the step does not fire it again. Node-level
faults are fired by the node's local rank 0 against its own agent, so only processes of
this job are ever signalled. Time-based faults, ``add-node`` and ``partition`` are the
host's (``chaos.inject``).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from pathlib import Path

from elastic_harness.chaos.schedule import hits
from elastic_harness.spec import FaultSpec


class WorkerFaults:
    def __init__(self, faults: Sequence[FaultSpec], *, rank: int, node: str, local_rank: int,
                 marker_dir: Path, events) -> None:
        self.faults = list(faults)
        self.rank, self.node, self.local_rank = rank, node, local_rank
        self.marker_dir, self.events = marker_dir, events

    def after_step(self, step: int) -> None:
        for i, f in enumerate(self.faults):
            if hits(f, step, self.rank, self.node, self.local_rank) and self._claim(i):
                self.events.emit("fault", kind=f.kind, target=f.target, step=step, rank=self.rank,
                                 detail=_fire(f))
                _execute(f)

    def _claim(self, i: int) -> bool:
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        try:
            os.close(os.open(self.marker_dir / f"fault-{i}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False


def _fire(f: FaultSpec) -> str:
    return {
        "kill-worker": f"SIGKILL rank {f.target} (pid {os.getpid()})",
        "hang": f"SIGSTOP rank {f.target} (pid {os.getpid()})",
        "preempt": f"SIGTERM node {f.target}'s agent (pid {os.getppid()})",
        "kill-node": f"SIGKILL node {f.target}'s agent (pid {os.getppid()}) and so its workers",
    }[f.kind]


def _execute(f: FaultSpec) -> None:
    if f.kind == "kill-worker":
        os.kill(os.getpid(), signal.SIGKILL)
    elif f.kind == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif f.kind == "preempt":
        os.kill(os.getppid(), signal.SIGTERM)
    elif f.kind == "kill-node":
        # Workers carry PR_SET_PDEATHSIG, so the agent's death takes the whole node down.
        os.kill(os.getppid(), signal.SIGKILL)
