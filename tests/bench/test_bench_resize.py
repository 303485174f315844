"""``bench recovery --only scale-up / churn``: the pure pieces (join phases, the churn
schedule, the summaries), and one tiny churn run end to end (the bench's plumbing only)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from elastic_harness.bench.recovery import join_stats, resize
from elastic_harness.bench.recovery import main as recovery
from elastic_harness.chaos.vocabulary import parse_fault
from tests.report.test_report import ev, steps


def joined_run(source: str = "peer") -> list[dict]:
    """Node 0 (agent pid 2) trains alone (rank 0 pid 10) from t=5; node 1 is started at t=10
    (host pid 1), its agent (pid 3) is up at 14 and joins at 14.2, the old generation (last
    step at 15.0) drains at 15, the round
    completes at 16.5, the new rank 0 (pid 20) forms its group 17.0-17.2, resumes at 17.5
    and completes its first step at 17.6."""
    return [
        ev(0.0, "start", 1, who="host"), ev(1.0, "start", 2, who="agent", node="0"),
        ev(4.0, "rendezvous", 10, world_size=1, pg_init_s=0.1), ev(4.5, "resume", 10, fresh=True, step=0),
        *steps(10, 1, 100, 5.0, 0.1, world_size=1),
        ev(10.0, "fault", 1, kind="add-node", target=0, step=50, node="1"),
        ev(14.0, "start", 3, who="agent", node="1"),
        ev(14.2, "torchelastic", 3, node="1", name="dynamic_rendezvous.py:_Handler.next_rendezvous"),
        ev(15.0, "drain", 10, step=100, world_size=1),
        ev(16.5, "torchelastic", 2, name="dynamic_rendezvous.py:_mark_rendezvous_complete"),
        ev(17.2, "worker", 20, rank=0, node="0"), ev(17.2, "rendezvous", 20, world_size=2, pg_init_s=0.2),
        ev(17.21, "worker", 21, rank=1, node="1"),
        ev(17.5, "resume", 20, step=100, source=source, load_s=0.05, saved_world_size=1, world_size=2,
           **({"phases_s": {"offers": 0.01, "layout": 0.02, "transfer": 0.015, "load": 0.005, "keep": 0.0}}
              if source == "peer" else {})),
        *steps(20, 101, 110, 17.5, 0.1),
    ]


def test_a_join_is_timed_from_the_new_agent_up_to_the_first_step_at_the_new_size():
    (rec,) = join_stats.joins(joined_run())
    assert rec["join_s"] == pytest.approx(3.4) and rec["boot_s"] == pytest.approx(4.2)
    assert rec["paused_s"] == pytest.approx(2.6)
    assert rec["phases_s"] == pytest.approx({"notice": 0.8, "rendezvous": 1.5, "spawn": 0.5,
                                             "process_group": 0.2, "restore": 0.3, "first_step": 0.1})
    assert sum(rec["phases_s"].values()) == pytest.approx(rec["join_s"])
    assert (rec["source"], rec["world_size"], rec["saved_world_size"]) == ("peer", 2, 1)
    # The restore phase split: before the load (building the run) and the tier's own phases.
    assert rec["before_load_s"] == pytest.approx(0.25) and rec["tier_phases_s"]["transfer"] == 0.015


def test_a_node_that_never_joined_has_no_phases_and_a_later_drain_is_not_its():
    events = [e for e in joined_run() if e["t"] < 16.0]  # stopped after the drain, before the round
    (rec,) = join_stats.joins(events)
    assert rec["join_s"] is None and set(rec["phases_s"].values()) == {None}
    assert rec["boot_s"] == pytest.approx(4.2)


def test_scale_up_reports_the_ratio_and_whether_the_peer_arm_read_storage():
    runs = {"peer": join_stats.joins(joined_run("peer")) * 2,
            "storage": join_stats.joins([{**e, "t": e["t"] + (1.0 if e["t"] >= 17.5 else 0.0)}
                                         for e in joined_run("storage")]) * 2}
    out = resize.scale_up_result(runs, repeats=2)
    assert out["ratio"] == pytest.approx(3.4 / 4.4, abs=1e-3)
    assert out["no_storage_read"] is True and out["sources"]["storage"] == ["storage", "storage"]
    assert out["median_phases_s"]["peer"]["tier.layout"] == 0.02 and "tier.layout" not in out["median_phases_s"]["storage"]
    runs["peer"][1] = {**runs["peer"][1], "source": "storage"}
    assert resize.scale_up_result(runs, repeats=2)["no_storage_read"] is False
    assert recovery.goals_met({"scale_up": out}, repeats=2)["note"].startswith("--repeats 2")


def test_churn_schedule_kills_the_newest_non_host_node_and_replaces_it():
    sched = resize.churn_schedule(600, 120, 10)
    assert sched[:4] == [(120, "kill-node:1"), (130, "add-node"), (240, "kill-node:2"), (250, "add-node")]
    assert len(sched) == 8 and sched[-1] == (490, "add-node")
    for _, text in sched:
        parse_fault(text)  # each is a fault the chaos command takes
    assert resize.churn_schedule(130, 120, 10) == []  # its replacement would start at the end: none


def test_churn_result_judges_the_goal_only_at_its_setting():
    events = joined_run()
    events.insert(-12, ev(12.0, "fault", 1, kind="kill-node", target=1, step=70, node="1"))
    short = resize.churn_result(events, ["kill-node:1@+12s"], 130, duration=40, every=20)
    assert short["faults_fired"] == {"kill-node": 1, "add-node": 1}
    assert short["at_goal_setting"] is False and short["met"] is False
    assert set(short["badput_s"]) >= {"startup", "rendezvous", "restart", "lost_work"}
    assert short["resume_sources"] == {"fresh": 1, "peer": 1} and short["world_sizes"] == [1, 2]
    assert len(short["joins"]) == 1 and len(short["kills"]) == 1
    assert short["join_drains"] == {"memory": 0, "storage_writes": 1, "stop": None}  # no ``saved``: storage
    assert short["storage_writes_per_join"] == 1.0
    # start-up by phase; the moments this synthetic run lacks (first round, spawn) span into the next
    assert short["startup"] == {"total_s": 4.5, "phases_s": pytest.approx(
        {"agents": 1.0, "rendezvous": None, "spawn": None, "worker_init": 2.9, "process_group": 0.1,
         "build_restore": 0.5})}
    in_memory = [{**e, "saved": "memory"} if e["event"] == "drain" else e for e in events]
    stopped = [*in_memory, ev(30.0, "drain", 20, step=110, world_size=2, saved="storage")]
    out = resize.churn_result(stopped, [], 130, duration=40, every=20)
    assert out["join_drains"] == {"memory": 1, "storage_writes": 0, "stop": "storage"}
    assert out["storage_writes_per_join"] == 0.0
    assert resize.churn_result(events, [], 0, duration=600, every=120)["at_goal_setting"] is True


@pytest.mark.e2e
@pytest.mark.timeout(420)
def test_a_tiny_churn_bench_fires_its_faults_and_prints_the_goodput(tmp_path):
    """Plumbing only, no timing judged: a 2-node run, one kill and one replacement."""
    out = tmp_path / "churn.json"
    cmd = [sys.executable, "-m", "elastic_harness", "bench", "recovery", "--only", "churn",
           "--churn-duration", "12", "--churn-every", "6", "--churn-replace-after", "1",
           "--dir", str(tmp_path), "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-2000:]
    churn = json.loads(out.read_text())["churn"]
    assert churn["faults_fired"] == {"kill-node": 1, "add-node": 1}, churn.get("log_tails")
    assert churn["schedule"] == ["kill-node:1@+6s", "add-node@+7s"]
    assert 0 < churn["goodput"] < 1 and churn["productive_s"] > 0
    assert set(churn["badput_s"]) == set(recovery_badput())
    assert churn["at_goal_setting"] is False and churn["met"] is False
    assert churn["startup"]["total_s"] > 0 and churn["join_drains"]["storage_writes"] == 0, churn["join_drains"]
    assert [p.name for p in tmp_path.iterdir()] == ["churn.json"]  # the scratch dir is gone


def recovery_badput() -> tuple[str, ...]:
    from elastic_harness.records.goodput import BADPUT_KINDS

    return BADPUT_KINDS
