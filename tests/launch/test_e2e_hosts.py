"""Separate hosts (issue 36, item 3): every node in its own pid, UTS and network namespace.

Needs root (CI runs as root). No same-host shortcut can apply: the survivor cannot see the
lost node's pids, so the lost node is judged by its host's kernel refusing its agent's
beacon (``rendezvous.probe``).
"""

from __future__ import annotations

import os

import pytest

from tests.audit import audit
from tests.conftest import MLP, cli
from tests.e2e.test_e2e_cluster import ELASTIC, HEAVY
from tests.lanes import DETECTION
from tests.launch.test_liveness_e2e import drops

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(420),
    pytest.mark.skipif(os.geteuid() != 0, reason="namespaces need root (CI runs as root)"),
    DETECTION,
]


def test_a_killed_node_on_another_host_is_dropped_by_its_hosts_answer(tmp_path):
    r = cli("run", str(MLP), "--separate-hosts", "--nodes", "2", *ELASTIC, *HEAVY,
            "--set", "train.steps=80", "--chaos", "kill-node:1@30", run_dir=tmp_path)
    assert r.code == 0, r.err
    (start,) = [e for e in r.kinds("start") if e.get("who") == "host"]
    assert start["separate_hosts"] is True
    agents = {e["node"]: e["pid"] for e in r.kinds("start") if e.get("who") == "agent"}
    assert agents == {"0": 2, "1": 2}, "each agent is its host's first process after the init"
    assert [f["kind"] for f in r.kinds("fault")] == ["kill-node"]
    assert [g["world_size"] for g in r.kinds("rendezvous")] == [2, 1]
    (dropped,) = drops(r)
    assert "process is gone" in dropped, dropped
    audit(tmp_path, 1024, 30, 80)
