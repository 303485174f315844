"""A real network partition: every node in its own network namespace, one link cut.

Needs root (CI runs as root) and iproute2. The job rendezvous through a real etcd in the
root namespace, reached over the namespaces' bridge.
"""

from __future__ import annotations

import os

import pytest

from tests.audit import audit
from tests.conftest import MLP, cli
from tests.servers import etcd_server
from tests.test_e2e_cluster import ELASTIC, HEAVY, G

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(420),
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root (CI runs as root)"),
]


def test_partitioned_node_is_dropped_and_stays_out_after_the_link_heals(tmp_path):
    steps = 400
    with etcd_server(tmp_path / "etcd-data", listen_all=True) as endpoint:
        r = cli("run", str(MLP), "--netns", "--nodes", "2", *ELASTIC, *HEAVY,
                "--set", f"train.steps={steps}", "--set", "rendezvous.backend=etcd",
                "--set", f"rendezvous.endpoint={endpoint}", "--set", "timeouts.step=5",
                "--set", "rendezvous.isolation_timeout=6",
                "--set", "chaos=[{kind: partition, target: 1, at_step: 40, duration: 20}]",
                run_dir=tmp_path / "run", timeout=400)
    assert r.code == 0, r.err
    events = r.events
    (cut,) = [e for e in events if e["event"] == "fault" and e["kind"] == "partition"]
    (isolated,) = [e for e in events if e["event"] == "isolated"]
    assert isolated["node"] == "1" and isolated["t"] > cut["t"]
    exits = {e["node"]: e["code"] for e in r.kinds("exit") if e.get("who") == "agent"}
    assert exits == {"1": 1, "0": 0}
    # The survivors went on alone; nothing of node 1 started after the cut.
    assert [g["world_size"] for g in r.kinds("rendezvous")][-1] == 1
    late_node1 = [e for e in events if e["event"] == "worker" and e["node"] == "1" and e["t"] > cut["t"]]
    assert late_node1 == []
    # The link came back while the survivors trained: node 1 did not rejoin or write.
    (heal,) = [e for e in events if e["event"] == "fault" and e["kind"] == "heal"]
    assert heal["t"] > isolated["t"]
    assert not [e for e in events if e["t"] > cut["t"] and e.get("pid") in node1_pids(events)
                and e["event"] not in ("isolated", "exit")]
    audit(tmp_path / "run", 1024, G, steps)


def node1_pids(events: list[dict]) -> set[int]:
    """Processes of node 1: its agent and every worker it ever started."""
    pids = {e["pid"] for e in events if e["event"] == "start" and e.get("node") == "1"}
    return pids | {e["pid"] for e in events if e["event"] == "worker" and e["node"] == "1"}


def test_partition_needs_netns(tmp_path):
    r = cli("run", str(MLP), "--set", "train.steps=30", "--chaos", "partition:0@5",
            run_dir=tmp_path, timeout=120)
    assert r.code == 2 and "needs simulated hosts" in r.err and "--netns" in r.err
