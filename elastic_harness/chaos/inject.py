"""Carry out faults against a ``LocalCluster``; every fault fired is logged as an event.

Worker pids come from the ``worker`` events each rank writes at start, so ``kill-worker 1``
kills whichever process is rank 1 now. Node faults act on a node's process group, which
``LocalCluster`` started: nothing this module did not start is ever signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Sequence

from elastic_harness.chaos.schedule import due
from elastic_harness.cluster import LocalCluster
from elastic_harness.events import EventLog
from elastic_harness.spec import FaultSpec


class ChaosController:
    def __init__(self, faults: Sequence[FaultSpec], events: EventLog, clock=time.monotonic) -> None:
        self.faults = list(faults)
        self.events = events
        self.clock = clock
        self.t0 = clock()
        self.fired: set[int] = set()
        self.step = 0
        self.workers: dict[int, int] = {}  # rank -> pid, latest generation

    def observe(self, e: dict, cluster: LocalCluster) -> None:
        if e["event"] == "worker":
            self.workers[e["rank"]] = e["pid"]
        elif e["event"] == "step":
            self.step = max(self.step, e["step"])
        self.tick(cluster)

    def tick(self, cluster: LocalCluster) -> None:
        for i in due(self.faults, self.fired, self.step, self.clock() - self.t0):
            f = self.faults[i]
            if f.kind in ("kill-worker", "hang") and f.target not in self.workers:
                continue  # that rank has not started yet; try again later
            self.fired.add(i)
            detail = fire(f, cluster, self.workers)
            self.events.emit("fault", kind=f.kind, target=f.target, step=self.step, detail=detail)


def fire(f: FaultSpec, cluster: LocalCluster, workers: dict[int, int]) -> str:
    if f.kind == "kill-worker":
        _kill_pid(workers[f.target], signal.SIGKILL)
        return f"SIGKILL rank {f.target} (pid {workers[f.target]})"
    if f.kind == "hang":
        _kill_pid(workers[f.target], signal.SIGSTOP)
        return f"SIGSTOP rank {f.target} (pid {workers[f.target]})"
    if f.kind == "kill-node":
        cluster.signal_node(f.target, signal.SIGKILL)
        return f"SIGKILL node {f.target} (agent and workers)"
    if f.kind == "preempt":
        # Only the agent: it forwards SIGTERM to its workers, which drain and save.
        os.kill(cluster.nodes[f.target].proc.pid, signal.SIGTERM)
        return f"SIGTERM node {f.target} agent"
    if f.kind == "add-node":
        node = cluster.add_node()
        return f"started node {node.index}"
    raise NotImplementedError(f"fault kind '{f.kind}' needs --netns (not available in this mode)")


def _kill_pid(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
