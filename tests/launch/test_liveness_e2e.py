"""A dead node sooner, end to end (``rendezvous.liveness``, issue 26 item 5): two simulated
nodes (real agents with their workers), one SIGKILLed or SIGSTOPped mid-run.

The SIGKILLed node is dropped by the new rule (its agent's process is gone and the
survivor's worker lost its connection to it); the SIGSTOPped one is alive, its peers see a
timeout rather than a closed connection: never dropped as a gone process, only as a silent
one (``rendezvous.verdict``) or by torch's keep-alive expiry.
"""

from __future__ import annotations

import pytest

from tests.audit import audit
from tests.conftest import MLP, cli
from tests.e2e.test_e2e_cluster import ELASTIC, HEAVY
from tests.lanes import DETECTION

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420), DETECTION]

DROPPED = "without waiting for its keep-alives to expire"


def drops(r) -> list[str]:
    return [e["message"] for e in r.kinds("torchelastic") if DROPPED in (e.get("message") or "")]


@pytest.mark.compat  # .ci/compat's end-to-end set (docs/torch-versions.md)
def test_a_killed_node_is_dropped_by_the_survivor_without_waiting(tmp_path):
    r = cli("run", str(MLP), "--nodes", "2", *ELASTIC, *HEAVY, "--set", "train.steps=80",
            "--chaos", "kill-node:1@30", run_dir=tmp_path)
    assert r.code == 0, r.err
    assert [f["kind"] for f in r.kinds("fault")] == ["kill-node"]
    assert [g["world_size"] for g in r.kinds("rendezvous")] == [2, 1]
    (dropped,) = drops(r)
    assert "process is gone" in dropped, dropped
    audit(tmp_path, 1024, 30, 80)


def test_a_frozen_node_is_never_taken_for_a_gone_process(tmp_path):
    """Its agent's process lives: the pid rule never drops it. The silence rule does (issue
    36: keep-alives and beacon silent while the survivor's group stalls, ``rendezvous.verdict``)."""
    r = cli("run", str(MLP), "--nodes", "2", *ELASTIC, *HEAVY, "--set", "train.steps=80",
            "--set", "timeouts.step=5", "--set", "timeouts.shutdown_grace=5",
            "--chaos", "hang-node:1@30", run_dir=tmp_path)
    assert r.code == 0, r.err
    assert [f["kind"] for f in r.kinds("fault")] == ["hang-node"]
    assert r.kinds("rendezvous")[-1]["world_size"] == 1
    assert not [d for d in drops(r) if "process is gone" in d], "a SIGSTOPped (live) process was taken for gone"
    assert all("rendezvous.verdict" in d for d in drops(r)), drops(r)
    audit(tmp_path, 1024, 30, 80)
