"""Carry out faults against a ``LocalCluster``; every fault fired is logged as an event.

Step-keyed faults on training processes fire inside the workers (``runtime.faults``); this
controller fires the rest: time-keyed faults, ``add-node``, and faults requested while the
job runs (``elastic-harness chaos RUN_DIR FAULT`` drops a request file in
``RUN_DIR/chaos/requests``). Worker pids come from the ``worker`` events each rank writes
at start; node faults act on processes ``LocalCluster`` started. Nothing else is signalled.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from elastic_harness.chaos.schedule import due, parse_fault
from elastic_harness.cluster import LocalCluster
from elastic_harness.errors import HarnessError
from elastic_harness.events import EventLog
from elastic_harness.spec import FaultSpec

REQUESTS = Path("chaos") / "requests"


def request(run_dir: Path, fault_text: str) -> Path:
    """Ask the ``run`` supervising ``run_dir`` to fire a fault now (validated here)."""
    parse_fault(fault_text)
    folder = run_dir / REQUESTS
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{uuid.uuid4().hex}.tmp"
    tmp.write_text(json.dumps({"fault": fault_text}))
    final = tmp.with_name(tmp.name[1:-4] + ".json")
    os.replace(tmp, final)
    return final


class ChaosController:
    def __init__(self, faults: Sequence[FaultSpec], events: EventLog, run_dir: Path,
                 clock=time.monotonic) -> None:
        self.faults = list(faults)
        self.events, self.run_dir, self.clock = events, run_dir, clock
        self.t0 = clock()
        self.fired: set[int] = set()
        self.step = 0
        self.workers: dict[int, tuple[int, str]] = {}  # rank -> (pid, node), latest generation
        self.heals: list[tuple[float, int]] = []  # (when, node) for timed partitions

    def observe(self, e: dict, cluster: LocalCluster) -> None:
        if e["event"] == "worker":
            self.workers[e["rank"]] = (e["pid"], str(e.get("node", "")))
        elif e["event"] == "step":
            self.step = max(self.step, e["step"])

    def tick(self, cluster: LocalCluster) -> None:
        self._take_requests()
        now = self.clock()
        for when, node in [h for h in self.heals if h[0] <= now]:
            self.heals.remove((when, node))
            cluster.netns.heal(node)
            self.events.emit("fault", kind="heal", target=node, step=self.step, detail=f"link of node {node} up")
        for i in due(self.faults, self.fired, self.step, self.clock() - self.t0):
            f = self.faults[i]
            if f.kind in ("kill-worker", "hang") and f.target not in self.workers:
                continue  # that rank has not started yet; try again later
            if f.kind == "hang-node" and str(f.target) not in {n for _, n in self.workers.values()}:
                continue
            self.fired.add(i)
            detail = fire(f, cluster, self.workers)
            if f.kind == "partition" and f.duration:
                self.heals.append((self.clock() + f.duration, f.target))
            self.events.emit("fault", kind=f.kind, target=f.target, step=self.step, detail=detail)

    def thaw(self, cluster: LocalCluster) -> None:
        """SIGCONT every process a hang froze, so shutdown is not held up by them."""
        for pid, _ in self.workers.values():
            _signal(pid, signal.SIGCONT)
        for index in cluster.running():
            cluster.signal_node(index, signal.SIGCONT)

    def _take_requests(self) -> None:
        folder = self.run_dir / REQUESTS
        if not folder.is_dir():
            return
        for path in sorted(folder.glob("*.json")):
            text = json.loads(path.read_text())["fault"]
            path.unlink()
            f = parse_fault(text)
            # Requested faults fire now, from the host, whatever their kind.
            self.faults.append(FaultSpec(kind=f.kind, target=f.target, at_seconds=0.001))


def fire(f: FaultSpec, cluster: LocalCluster, workers: dict[int, tuple[int, str]]) -> str:
    if f.kind == "kill-worker":
        _signal(workers[f.target][0], signal.SIGKILL)
        return f"SIGKILL rank {f.target} (pid {workers[f.target][0]})"
    if f.kind == "hang":
        _signal(workers[f.target][0], signal.SIGSTOP)
        return f"SIGSTOP rank {f.target} (pid {workers[f.target][0]})"
    if f.kind == "hang-node":
        # Freeze the whole node: its agent (keep-alives stop) and every worker it runs.
        pids = [pid for pid, node in workers.values() if node == str(f.target)]
        cluster.signal_node(f.target, signal.SIGSTOP)
        for pid in pids:
            _signal(pid, signal.SIGSTOP)
        return f"SIGSTOP node {f.target} (agent and workers {pids})"
    if f.kind == "kill-node":
        cluster.signal_node(f.target, signal.SIGKILL)  # workers die with their agent (PDEATHSIG)
        return f"SIGKILL node {f.target} (agent and workers)"
    if f.kind == "preempt":
        # Only the agent: it forwards SIGTERM to its workers, which drain and save.
        _signal(cluster.nodes[f.target].proc.pid, signal.SIGTERM)
        return f"SIGTERM node {f.target} agent"
    if f.kind == "add-node":
        node = cluster.add_node()
        return f"started node {node.index}"
    if f.kind == "partition" and cluster.netns is not None:
        cluster.netns.cut(f.target)
        return f"link of node {f.target} down"
    if f.kind == "heal" and cluster.netns is not None:
        cluster.netns.heal(f.target)
        return f"link of node {f.target} up"
    raise HarnessError(f"fault '{f.kind}' needs simulated hosts", "run with --netns (as root)")


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
