"""In-place recovery end to end (``recovery: in_place``, the default; docs/in-place.md): a
fault stops only what it broke. Each test checks which processes kept their pid (the
``recovery`` event against the first generation's ``worker`` events), and that the result is
the one a restart of every worker gives: the uninterrupted run's, bit for bit, at an equal
world size; the same fault recovered by a restart (``recovery: restart``), bit for bit,
where the world shrank at a step the fault fixes; every sample once (the audit).

The mesh layouts' in-place runs (tensor parallel + FSDP2, HSDP) are in
tests/runtime/test_e2e_layout.py, the script's in tests/runtime/test_byo_e2e.py.
"""

from __future__ import annotations

import pytest

from elastic_harness.report.timeline import build
from tests.audit import audit
from tests.conftest import MLP, cli, final_ckpt, model_of
from tests.e2e.test_e2e_core import assert_close
from tests.lanes import DETECTION

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420), DETECTION]

N, G, STEPS = 1024, 30, 60
RECORD = ["--set", "train.record_samples=true"]
TWO_NODES = ["--nodes", "2", "--nproc-per-node", "1", "--set", "nodes.min=1", "--set", "nodes.max=2"]


def first_pids(r) -> dict[int, int]:
    """rank -> pid of the first generation's workers."""
    return {e["rank"]: e["pid"] for e in r.kinds("worker") if e["restart"] == 0}


def last_pids(r) -> set[int]:
    """The pids of the last generation's workers."""
    last = max(e["restart"] for e in r.kinds("worker"))
    return {e["pid"] for e in r.kinds("worker") if e["restart"] == last}


def test_a_crashed_worker_is_replaced_and_its_peer_keeps_its_process(mlp_reference, tmp_path):
    r = cli("run", str(MLP), *RECORD, "--chaos", "kill-worker:1@20", run_dir=tmp_path)
    assert r.code == 0, r.err
    (rec,) = r.kinds("recovery")
    before = first_pids(r)
    assert rec["kept"] == [before[0]] and len(rec["new"]) == 1 and before[1] not in rec["new"]
    assert rec["mode"] == "rerun", "a new worker joins: the survivor runs the loop again beside it"
    (reformed,) = r.kinds("reformed")
    assert reformed["pid"] == before[0] and set(reformed["phases_s"]) == {"leave", "park", "reform"}
    assert "recovered in place: 1 of 2 workers kept their process" in r.err
    shown = cli("report", str(tmp_path), "--no-plot")
    assert shown.code == 0, shown.err
    assert "1 recovered (1 in place)" in shown.out
    assert (f"#0 in place (rerun); 1 of 1 survivor(s) kept their process; kept: rank 0 (pid {before[0]}); "
            f"new: rank 1 (pid {rec['new'][0]}); leave ") in shown.out
    assert r.summary["model_digest"] == mlp_reference.summary["model_digest"]
    assert r.kinds("resume")[-1]["source"] == "memory"
    audit(tmp_path, N, G, STEPS)


@pytest.mark.parametrize("parallelism, mode, said", [("ddp", "repoint", "finish"), ("fsdp", "rerun", "rerun")])
def test_a_lost_node_is_left_behind_by_survivors_that_keep_their_processes(tmp_path, parallelism, mode, said):
    """Node 1 of 2 SIGKILLed at step 20: the survivor re-forms alone. DDP re-points its run
    (nobody new) and finishes step 21, in flight when the node died, without it (the restart
    redoes it from memory: the two agree within the tolerance of a resize, the sums' order
    differs). FSDP runs its loop again (its shards were cut for two) and
    reshards the lost node's buddy copy in memory; the newest step whose copies were complete
    when the node died is a matter of timing (19 or 20), so there the two agree within the
    tolerance of a resize (docs/tolerance.md)."""
    args = [*TWO_NODES, *RECORD, "--set", f"parallelism={parallelism}", "--chaos", "kill-node:1@20"]
    r = cli("run", str(MLP), *args, run_dir=tmp_path / "in-place")
    assert r.code == 0, r.err
    (rec,) = r.kinds("recovery")
    assert rec["mode"] == mode and rec["kept"] == [first_pids(r)[0]] and rec["new"] == []
    assert [g["world_size"] for g in r.kinds("rendezvous")] == [2, 1]
    restart = cli("run", str(MLP), *args, "--set", "recovery=restart", run_dir=tmp_path / "restart")
    assert restart.code == 0, restart.err
    assert restart.kinds("recovery") == [], "a restart keeps no process"
    (kept,) = build(r.events).faults
    assert (kept.recovered_how.way, kept.recovered_how.mode, kept.recovered_how.survivors_kept) == ("in place", said, 1)
    assert sum(kept.recovered_how.phases_s.values()) == pytest.approx(kept.recovery_s, abs=1e-3)
    (lost,) = build(restart.events).faults
    assert (lost.recovered_how.way, lost.recovered_how.survivors_kept, lost.recovered_how.fell_back) == (
        "restart", 0, False), "the survivor was restarted, as asked: no fall back"
    if parallelism == "ddp":
        assert [(e["step"], e["lost_dp_ranks"]) for e in r.kinds("finished")] == [(21, [1])]
    assert_close(model_of(final_ckpt(r.run_dir)), model_of(final_ckpt(restart.run_dir)))
    audit(tmp_path / "in-place", N, G, STEPS)


def test_a_frozen_node_is_left_behind_and_the_survivor_keeps_its_process(tmp_path):
    """Node 1 frozen (SIGSTOP: no connection is reset): the survivor's collective is left
    (its connections to the frozen node closed from this side) on the watchdog's verdict."""
    r = cli("run", str(MLP), *TWO_NODES, *RECORD, "--set", "train.steps=100", "--chaos", "hang-node:1@20",
            run_dir=tmp_path)
    assert r.code == 0, r.err
    (rec,) = r.kinds("recovery")
    assert rec["mode"] == "repoint" and rec["kept"] == [first_pids(r)[0]]
    assert [g["world_size"] for g in r.kinds("rendezvous")] == [2, 1]
    assert not [e for e in r.kinds("failure") if e.get("cause") == "hang"], "nobody waited out a timeout"
    audit(tmp_path, N, G, 100)


@pytest.mark.parametrize("forced", ["silent", "reform", "restore", "die"])
def test_each_failure_of_the_in_place_path_ends_in_a_new_worker_and_loses_nothing(mlp_reference, tmp_path, forced):
    """Rank 0 survives rank 1's crash, then fails on its way through the in-place path (does
    not park; its re-formation or its restore throws; it dies while re-forming): it is started
    anew, as a restart would, and the run ends as the uninterrupted one, bit for bit."""
    r = cli("run", str(MLP), *RECORD, "--chaos", "kill-worker:1@20", "--set", "timeouts.step=10", run_dir=tmp_path,
            env={"ELASTIC_HARNESS_INPLACE_FAULT": f"{forced}:0"})
    assert r.code == 0, r.err
    assert first_pids(r)[0] not in last_pids(r), "the survivor that failed in place did not go on"
    (how,) = [f.recovered_how for f in build(r.events).faults if f.injected]
    assert how.survivors_kept == 0 and how.fell_back, "report: the in-place path was taken and failed"
    if forced == "silent":
        assert [e for e in r.kinds("workers") if e["state"] == "unparked"]
        assert "did not leave its step in time" in r.err
    assert r.summary["model_digest"] == mlp_reference.summary["model_digest"]
    audit(tmp_path, N, G, STEPS)
