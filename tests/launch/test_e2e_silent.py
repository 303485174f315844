"""Silent nodes, end to end (issue 36, item 1): two simulated nodes with real agents.

A frozen node (SIGSTOP of its agent and workers) resets no connection: the survivor's
worker stalls, its agent finds the frozen node's keep-alives and beacon silent
(``rendezvous.verdict``) and the job goes on without it, long before ``timeouts.step``. A
node that is slow but alive (a rank pausing, unannounced) is waited for: no verdict, no
restart. Work a script announces (``run.phase``) widens the step timeout itself.
"""

from __future__ import annotations

import pytest

from tests.audit import audit
from tests.conftest import MLP, REPO, cli
from tests.e2e.test_e2e_cluster import ELASTIC, HEAVY
from tests.lanes import DETECTION

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420), DETECTION]

STRAGGLER = REPO / "tests" / "scripts" / "straggler.py"
TWO_NODES = ["--nodes", "2", *ELASTIC, "--nproc-per-node", "1"]


def script(run_dir, *args: str):
    """``run [flags] SCRIPT ARGS`` (the run dir goes before the script: after it, it is the
    script's own argument)."""
    r = cli("run", "--run-dir", str(run_dir), *args)
    r.run_dir = run_dir
    return r


def causes(r) -> list[str]:
    return [e.get("cause") or "exception" for e in r.kinds("failure")]


def test_a_frozen_node_is_judged_gone_on_evidence_not_at_the_step_timeout(tmp_path):
    # torch's own expiry (keep-alive interval x attempts: 3 s by default) put past any stall
    # bound: a loaded machine's steps stretch the bound (4.4 s at load 9), and then the expiry
    # dropped node 1 before the verdict could, which is not the path this test is about.
    r = cli("run", str(MLP), *TWO_NODES, *HEAVY, "--set", "train.steps=80",
            "--set", "rendezvous.keep_alive_max_attempt=20",
            "--chaos", "hang-node:1@30", run_dir=tmp_path)  # timeouts.step: the default minute
    assert r.code == 0, r.err
    assert [f["kind"] for f in r.kinds("fault")] == ["hang-node"]
    lost = [e for e in r.kinds("failure") if e.get("cause") == "node-lost"]
    assert lost and lost[0]["node"] == "0" and lost[0]["gone"], causes(r)
    assert "beacon did not answer" in lost[0]["message"]
    assert "hang" not in causes(r), "the step timeout never had to fire"
    assert [g["world_size"] for g in r.kinds("rendezvous")] == [2, 1]
    audit(tmp_path, 1024, 30, 80)


def test_a_slow_node_that_is_alive_is_waited_for(tmp_path):
    """Rank 1 pauses 6 s after step 20 without saying so: rank 0 stalls past its bound, its
    agent asks, finds node 1's agent alive (keep-alives, beacon), and waits."""
    r = script(tmp_path, *TWO_NODES, "--set", "train.steps=40", "--set", "timeouts.step=30",
               str(STRAGGLER), "1", "20", "6")
    assert r.code == 0, r.err
    stalls = r.kinds("stall")  # rank 1 stalls too, in its own pause
    assert any(s["node"] == "0" for s in stalls), "rank 0 stalled past its bound: its agent looked"
    assert causes(r) == [], "a live node was taken for a dead one"
    assert [g["world_size"] for g in r.kinds("rendezvous")] == [2]


@pytest.mark.parametrize("announced", [True, False])
def test_a_phase_the_script_announces_widens_the_step_timeout(tmp_path, announced):
    """Every rank pauses 8 s after step 10, with timeouts.step=4: announced, no hang; not
    announced, the watchdog takes the pause for one (the control)."""
    args = [str(STRAGGLER), "all", "10", "8", *(["phase"] if announced else [])]
    r = script(tmp_path, "--set", "train.steps=20", "--set", "timeouts.step=4", "--set", "max_restarts=1", *args)
    if announced:
        assert r.code == 0, r.err
        assert causes(r) == []
    else:
        assert "hang" in causes(r)
