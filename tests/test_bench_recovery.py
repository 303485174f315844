"""``bench recovery``: its pure pieces only (schedules, summaries); the bench itself is long."""

from __future__ import annotations

from elastic_harness.bench import recovery
from elastic_harness.chaos.vocabulary import parse_fault
from tests.test_report import killed_worker_run


def test_kill_worker_schedule_spreads_faults_over_the_save_interval():
    sched = recovery.kill_worker_schedule(20, every=10)
    faults = [parse_fault(s) for s in sched]
    steps = [f.at_step for f in faults]
    assert len(set(steps)) == 20 and steps == sorted(steps)
    assert {f.target for f in faults} == {0, 1}
    assert len({s % 10 for s in steps}) >= 3  # not always the same distance past a save
    assert all(s % 10 for s in steps)  # never on a save step


def test_goodput_schedule_is_seeded_and_ends_with_a_drain():
    a = recovery.goodput_schedule(120, 20, seed=3, ranks=2)
    assert a == recovery.goodput_schedule(120, 20, seed=3, ranks=2)
    faults = [parse_fault(s) for s in a]
    assert faults[-1].kind == "preempt" and faults[-1].at_seconds == 120
    kills = faults[:-1]
    assert len(kills) == 5 and all(f.kind == "kill-worker" for f in kills)
    assert all(abs(f.at_seconds - 20 * (i + 1)) <= 5 for i, f in enumerate(kills))


def test_restart_stats_counts_first_try_recoveries():
    events = killed_worker_run()
    for e in events:
        if e["event"] == "step":
            e["restart"] = 0 if e["pid"] == 10 else 1
    stats = recovery.restart_stats(events, requested=1, code=0)
    assert (stats["fired"], stats["recovered"], stats["recovered_first_try"]) == (1, 1, 1)
    assert stats["steps_lost"] == [5] and stats["finished"]
    for e in events:
        if e["event"] == "step" and e["pid"] == 20:
            e["restart"] = 2  # the first restart failed: the agent needed a second
    assert recovery.restart_stats(events, requested=1, code=0)["recovered_first_try"] == 0


def test_goals_are_reported_per_part():
    report = {"kill_node": {"met": True}, "goodput": {"met": {"goodput": False, "lost_work": True}}}
    met = recovery.goals_met(report, repeats=2)
    assert met["kill_node_ratio"] is True and met["goodput_goodput"] is False
    assert "indicative" in met["note"]
