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
from collections.abc import Collection, Sequence
from pathlib import Path

from elastic_harness import runfiles
from elastic_harness.chaos.schedule import due, unfired
from elastic_harness.chaos.vocabulary import KINDS, Kind, fire_now, parse_fault
from elastic_harness.events import EventLog
from elastic_harness.simcluster.cluster import LocalCluster
from elastic_harness.spec import FaultSpec

REQUESTS = Path(runfiles.CHAOS) / "requests"


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
        self.heals: list[tuple[float, int, str]] = []  # (when, node, kind) for timed partitions and hangs
        self.done: list[dict] = []  # the fault events seen (worker- and host-fired)
        self.joined: set[str] = set()  # every node a worker reported from, in any generation

    def observe(self, e: dict, cluster: LocalCluster) -> None:
        if e["event"] == "worker":
            self.workers[e["rank"]] = (e["pid"], str(e.get("node", "")))
            self.joined.add(str(e.get("node", "")))
        elif e["event"] == "step":
            self.step = max(self.step, e["step"])
        elif e["event"] == "fault":
            self.done.append(e)

    def unfired(self) -> list[FaultSpec]:
        """Faults this run was given (or asked for) that no ``fault`` event shows fired, less
        those a worker fired in an earlier run of this directory (``runtime.faults``' marker
        ``chaos/fault-I``: a step-keyed fault fires once per run directory)."""
        return [self.faults[i] for i in unfired(self.faults, self.done)
                if not (self.run_dir / runfiles.CHAOS / runfiles.fault_marker(i)).exists()]

    def unjoined(self, running: Collection[int]) -> list[int]:
        """Of the ``running`` nodes, those no worker has ever reported from: started (say,
        by ``add-node``) but never part of the job."""
        return [i for i in running if str(i) not in self.joined]

    def tick(self, cluster: LocalCluster) -> None:
        self._take_requests()
        now = self.clock()
        for when, node, kind in [h for h in self.heals if h[0] <= now]:
            self.heals.remove((when, node, kind))
            self.events.emit("fault", kind="heal", target=node, step=self.step, node=str(node),
                             detail=self._heal(cluster, node, kind))
        for i in due(self.faults, self.fired, self.step, self.clock() - self.t0):
            f = self.faults[i]
            if not ready(f, self.workers, cluster.nodes):
                continue  # that rank or node has not started yet; try again later
            self.fired.add(i)
            node, detail = fire(f, cluster, self.workers)
            if f.kind in ("partition", "hang-node") and f.duration:
                self.heals.append((self.clock() + f.duration, f.target, f.kind))
            self.events.emit("fault", kind=f.kind, target=f.target, step=self.step, node=node, detail=detail)

    def _heal(self, cluster: LocalCluster, node: int, kind: str) -> str:
        """End a timed fault on ``node``: bring its link up, or thaw it (SIGCONT)."""
        if kind == "partition":
            cluster.netns.heal(node)
            return f"link of node {node} up"
        cluster.signal_node(node, signal.SIGCONT)
        for pid, where in self.workers.values():
            if where == str(node):
                _signal(_here(cluster, where, pid), signal.SIGCONT)
        return f"node {node} thawed (SIGCONT)"

    def thaw(self, cluster: LocalCluster) -> None:
        """SIGCONT every process a hang froze, so shutdown is not held up by them."""
        for pid, node in self.workers.values():
            _signal(_here(cluster, node, pid), signal.SIGCONT)
        for index in cluster.running():
            cluster.signal_node(index, signal.SIGCONT)

    def _take_requests(self) -> None:
        folder = self.run_dir / REQUESTS
        if not folder.is_dir():
            return
        for path in sorted(folder.glob("*.json")):
            text = json.loads(path.read_text())["fault"]
            path.unlink()
            self.faults.append(fire_now(parse_fault(text)))


def ready(f: FaultSpec, workers: dict[int, tuple[int, str]], nodes: Collection[int]) -> bool:
    """Pure: does what ``f`` acts on exist yet? If not, the host tries again later."""
    kind = KINDS[f.kind]
    if kind.reaches == "rank":
        return f.target in workers
    if kind.target == "node" and f.target not in nodes:
        return False  # a node that add-node has not started yet
    # Freezing a node signals its workers one by one: wait until they have reported.
    return kind.reaches != "node" or str(f.target) in {n for _, n in workers.values()}


def fire(f: FaultSpec, cluster: LocalCluster, workers: dict[int, tuple[int, str]]) -> tuple[str, str]:
    """Carry out ``f`` as the vocabulary says. Returns (the node it hit, what was done)."""
    kind = KINDS[f.kind]
    if kind.how == "signal":
        node = workers[f.target][1] if kind.target == "rank" else str(f.target)
        return node, _send(kind, f.target, cluster, workers)
    if kind.how == "start-node":
        index = cluster.add_node().index
        return str(index), f"started node {index}"
    # check_netns refused link faults when the run has no namespaces (run and chaos commands).
    assert cluster.netns is not None, f"{f.kind} reached a run without --netns"
    if kind.how == "link-down":
        cluster.netns.cut(f.target)
        return str(f.target), f"link of node {f.target} down"
    cluster.netns.heal(f.target)
    return str(f.target), f"link of node {f.target} up"


def _send(kind: Kind, target: int, cluster: LocalCluster, workers: dict[int, tuple[int, str]]) -> str:
    sig = kind.signal
    if kind.reaches == "rank":
        pid, node = workers[target]
        _signal(_here(cluster, node, pid), sig)
        return f"{sig.name} rank {target} (pid {pid})"
    if kind.reaches == "agent":
        pid = cluster.agent_pid(target)
        _signal(pid, sig)
        return f"{sig.name} node {target}'s agent (pid {pid})"
    cluster.signal_node(target, sig)
    if kind.reaches == "agent-group":
        return f"{sig.name} node {target} (agent, and so its workers)"
    if cluster.nodes[target].separate:  # signal_node reached every process of that host
        return f"{sig.name} node {target} (every process of its host)"
    pids = [pid for pid, node in workers.values() if node == str(target)]
    for pid in pids:
        _signal(pid, sig)
    return f"{sig.name} node {target} (agent and workers {pids})"


def _here(cluster: LocalCluster, node: str, pid: int) -> int | None:
    """A worker's pid as its node reported it, in this machine's namespace (``host_pid``)."""
    return cluster.host_pid(int(node), pid) if node.isdigit() else pid


def _signal(pid: int | None, sig: int) -> None:
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
