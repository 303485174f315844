"""``bench recovery``: its pure pieces only (schedules, summaries); the bench itself is long."""

from __future__ import annotations

import pytest

from elastic_harness.bench.recovery import crash_stats
from elastic_harness.bench.recovery import main as recovery
from elastic_harness.chaos.vocabulary import parse_fault
from elastic_harness.report.probe import probe_cost
from tests.report.test_report import ev, killed_worker_run


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
    stats = crash_stats.restart_stats(events, requested=1, code=0)
    assert (stats["fired"], stats["recovered"], stats["recovered_first_try"]) == (1, 1, 1)
    assert stats["steps_lost"] == [5] and stats["finished"]
    for e in events:
        if e["event"] == "step" and e["pid"] == 20:
            e["restart"] = 2  # the first restart failed: the agent needed a second
    assert crash_stats.restart_stats(events, requested=1, code=0)["recovered_first_try"] == 0


def test_a_kill_before_the_first_step_is_counted_against_the_generation_it_hit():
    """No step before the fault: the restart it cost is counted from the generation that
    had formed (its ``rendezvous`` event), so a kill during start-up recovers on the first try."""
    events = [e for e in killed_worker_run() if not (e["event"] == "step" and e["pid"] == 10)]
    for e in events:
        if e["event"] == "step":
            e["restart"] = 1
    stats = crash_stats.restart_stats(events, requested=1, code=0)
    assert (stats["fired"], stats["recovered"], stats["recovered_first_try"]) == (1, 1, 1)
    events.append(ev(18.5, "fault", 11, kind="preempt", target=0, step=30))
    assert crash_stats.restart_stats(events, requested=1, code=0)["fired"] == 1  # the preempt is not a crash


def test_goals_are_reported_per_part():
    report = {"kill_node": {"met": True, "steps_redone_met": True},
              "goodput": {"met": {"goodput": False, "lost_work": True}}}
    met = recovery.goals_met(report, repeats=2)
    assert met["kill_node_ratio"] is True and met["goodput_goodput"] is False
    assert met["kill_node_steps_redone"] is True
    assert "indicative" in met["note"]


def test_recovery_breakdown_phases_add_up_to_the_recovery_time():

    events = [e for e in killed_worker_run() if e["event"] != "rendezvous" or e["pid"] != 20]
    events += [ev(12.6, "workers", 5, state="failed"), ev(12.65, "workers", 5, state="stopped"),
               ev(16.5, "rendezvous", 20, world_size=2, restart=1, pg_init_s=0.1)]
    events.sort(key=lambda e: e["t"])
    fault = next(e for e in events if e["event"] == "fault")
    phases = crash_stats.breakdown(events, fault)
    assert phases == pytest.approx({"detect": 0.05, "stop": 0.05, "rendezvous": 0.35, "spawn": 3.4,
                                    "process_group": 0.1, "restore": 0.5, "first_step": 0.1})
    assert sum(phases.values()) == pytest.approx(17.1 - 12.55)
    # torchrun records no agent events: the phases before the workers' own merge into spawn
    bare = [e for e in events if e["event"] not in ("workers", "torchelastic")]
    plain = crash_stats.breakdown(bare, fault)
    assert plain["detect"] is None and plain["rendezvous"] is None
    assert plain["spawn"] == pytest.approx(16.4 - 12.55)
    assert crash_stats.median_breakdown([phases, plain])["spawn"] == pytest.approx((3.4 + 3.85) / 2)


def test_memory_cost_compares_neighbouring_blocks_of_one_run():
    """A probed run: rank 0's step times, and the interval it set (0: off) after the step it
    applies from. A step holds the previous step's snapshot, so it counts by the interval in
    force for that previous step; the first step of each generation is left out."""
    def run(pid, first, last, on_s, off_s, block):
        out = []
        for i in range(first, last + 1):
            on_before = ((i - 2) // block) % 2 == 0  # the interval in force for step i - 1
            out.append(ev(float(i), "step", pid, step=i, step_s=on_s if on_before else off_s))
            if (i - 1) % block == 0:  # the first step of a block sets its interval
                out.append(ev(i + 0.5, "memory", pid, step=i, every=2 if ((i - 1) // block) % 2 == 0 else 0))
        return out

    events = run(7, 1, 40, 0.104, 0.1, 10)
    probe = probe_cost(events, skip=1)
    assert probe.cost == pytest.approx(0.04) and len(probe.pairs) == 3
    assert (probe.on_step_s, probe.off_step_s) == (pytest.approx(0.104), pytest.approx(0.1))
    # A machine slowing down: both neighbours of each block count, so drift favours no kind.
    drift = [dict(e, step_s=e["step_s"] * (1 + 0.001 * e["step"])) if e["event"] == "step" else e for e in events]
    assert probe_cost(drift, skip=1).cost == pytest.approx(0.04, abs=0.012)
    # Blocks of two generations are not compared with each other; a run never off has no cost.
    assert len(probe_cost(run(7, 1, 20, 0.104, 0.1, 10) + run(8, 1, 20, 0.104, 0.1, 10), skip=1).pairs) == 2
    assert probe_cost(run(7, 1, 10, 0.104, 0.1, 10), skip=1) is None
    assert probe_cost([ev(1.0, "step", 7, step=1, step_s=0.1)]) is None


def test_copy_share_and_quartiles():
    memory = [{"event": "memory", "copy_s": 0.0, "step_s": 0.0, "every": 1},  # the first, unmeasured
              {"event": "memory", "copy_s": 0.001, "step_s": 0.01, "every": 4},
              {"event": "memory", "copy_s": 0.001, "step_s": 0.01, "every": 3}]
    assert crash_stats.copy_share(memory) == pytest.approx(0.0292, abs=1e-4)  # median of 1/40 and 1/30
    assert crash_stats.copy_share([]) is None
    assert crash_stats.quartiles([0.01, 0.02, 0.03, 0.04, 0.05]) == [0.015, 0.045]
    assert crash_stats.quartiles([0.01]) is None


def test_a_failed_runs_log_tails_are_kept(tmp_path):
    from elastic_harness.bench.recovery.main import log_tails

    (tmp_path / "logs").mkdir()
    (tmp_path / "bench-host.log").write_text("".join(f"line {i}\n" for i in range(50)))
    (tmp_path / "logs" / "agent-0.log").write_text("Traceback\nboom\n")
    tails = log_tails(tmp_path, lines=3)
    assert tails == {"bench-host.log": ["line 47", "line 48", "line 49"], "agent-0.log": ["Traceback", "boom"]}


def test_kill_node_runs_report_the_tier_intervals_in_force_at_the_fault():
    from elastic_harness.bench.recovery.main import tier_before

    events = [{"event": "memory", "t": 1.0, "every": 1, "copy_s": 0.0, "step_s": 0.0},
              {"event": "memory", "t": 2.0, "every": 2, "copy_s": 0.0007, "step_s": 0.02, "copy_every": 1,
               "copy_cost_s": 0.0011},
              {"event": "fault", "t": 3.0, "step": 40},
              {"event": "memory", "t": 4.0, "every": 1, "copy_s": 0.0, "step_s": 0.0}]  # the next generation's
    assert tier_before(events) == {"snapshot_every": 2, "copy_every": 1, "snapshot_ms": 0.7, "copy_cost_ms": 1.1,
                                   "step_ms": 20.0}
    assert tier_before(events[:2]) is None  # no fault


def test_node_fault_rows_need_root_for_separate_hosts():
    from elastic_harness.bench.recovery import nodeloss

    assert nodeloss.rows_for(True) == ["same_host", "separate_hosts"]
    assert nodeloss.rows_for(False) == ["same_host"]


def test_a_node_fault_row_reports_runs_stopped_at_the_bound():
    from elastic_harness.bench.recovery import nodeloss

    ok = {"recovered": True, "recovery_s": 2.0, "phases": {"detect": 1.0, "rendezvous": 0.5}}
    stuck = {"recovered": False, "recovery_s": None, "phases": None, "stopped_at_bound_s": 240.0}
    row = nodeloss.summarize([ok, {**ok, "recovery_s": 4.0}], [stuck, {**ok, "recovery_s": 60.0}])
    assert row["median_s"] == 3.0 and row["ratio_to_torchrun"] == 0.05 and row["recovered"] == 2
    theirs = nodeloss.summarize([stuck, {**ok, "recovery_s": 60.0}], [])
    assert theirs["stopped_at_bound"] == 1 and theirs["recovered"] == 1 and theirs["ratio_to_torchrun"] is None
    assert row["phases_median_s"]["detect"] == 1.0


def test_torchrun_repeats_after_one_that_gave_up_are_skipped(tmp_path, monkeypatch):
    """A torchrun repeat that ran into the bound (420 s at 4 and 8 nodes) is not run again:
    the JSON says how many were skipped and why. The runs are stand-ins: the loop is tested."""
    from elastic_harness.bench.recovery import nodeloss

    ran: list[str] = []

    def torchrun(job, run_dir, nodes, kind, samples=None):
        ran.append(run_dir.name)
        return {"recovered": False, "recovery_s": None, "phases": None, "stopped_at_bound_s": 420.0}

    monkeypatch.setattr(nodeloss, "harness", lambda *a, **k: 0)
    monkeypatch.setattr(nodeloss, "measure", lambda *a, **k: {"recovered": True, "recovery_s": 0.1, "phases": None})
    monkeypatch.setattr(nodeloss, "torchrun_fault", torchrun)
    out = nodeloss.bench_node_fault(tmp_path, "kill-node", 3, 4)
    assert ran == ["kill-node-4-torchrun-0"]
    assert out["torchrun_repeats_skipped"] == 2 and "bound" in out["torchrun_skipped_why"]
    assert not nodeloss.gave_up([{"recovered": True, "stopped_at_bound": False}])
    assert nodeloss.skipped_note(0) == {}


def test_the_kill_node_bench_skips_torchrun_repeats_after_one_gave_up(tmp_path, monkeypatch):
    from elastic_harness.bench.recovery import main as recovery
    from elastic_harness.bench.recovery import nodeloss

    launched: list[str] = []

    def launch(launcher, job, run_dir, **_):
        launched.append(launcher)
        return None if launcher == "torchrun" else 0  # None: stopped by the bench at its bound

    monkeypatch.setattr(recovery, "launch", launch)
    monkeypatch.setattr(nodeloss, "harness", lambda *a, **k: 0)
    monkeypatch.setattr(recovery, "_one_recovery", lambda run_dir, code: {"recovery_s": 0.1 if code == 0 else None})
    monkeypatch.setattr(nodeloss, "measure", lambda *a, **k: {"cpu_busy": None, "cpu_s": None, "phases": None})
    out = recovery.bench_kill_node(tmp_path, 3, nodes=4)
    assert launched.count("torchrun") == 1 and launched.count("harness") == 3
    assert out["torchrun_stopped_at_bound"] == 1 and out["torchrun_repeats_skipped"] == 2


def test_node_fault_goals():
    from elastic_harness.bench.recovery import nodeloss

    rows = {"same_host": {"median_s": 3.0}, "separate_hosts": {"median_s": 4.0}}
    assert nodeloss.goals("hang-node", rows)["met"]
    assert not nodeloss.goals("hang-node", {**rows, "separate_hosts": {"median_s": None}})["met"]
    assert not nodeloss.goals("kill-node", rows)["met"]
    assert nodeloss.goals("kill-node", {"separate_hosts": {"median_s": 0.3}})["met"]
    assert not nodeloss.goals("kill-node", {"separate_hosts": {"skipped": "needs root"}})["met"]


def test_a_soak_counts_every_verdict_hang_or_failure_as_a_false_detection():
    from elastic_harness.bench.recovery import nodeloss

    events = [{"event": "step", "step": 10}, {"event": "stall", "node": "0"}, {"event": "eval", "step": 10},
              {"event": "rendezvous"}, {"event": "step", "step": 11}]
    clean = nodeloss.soak_counts(events)
    assert clean["false_detections"] == 0 and clean["stalls_looked_at"] == 1 and clean["steps"] == 11
    bad = nodeloss.soak_counts([*events, {"event": "failure", "cause": "node-lost"}, {"event": "failure"}])
    assert (bad["node_lost"], bad["worker_failures"], bad["false_detections"]) == (1, 1, 2)


def test_survivors_that_kept_their_process_are_counted_from_the_events():
    """Each fault's account (``report.inplace``) read by the bench: the in-place run's survivor
    kept its pid, the restarted run's did not, and neither fell back; a fault whose in-place
    path failed is counted as a fall back."""
    from elastic_harness.bench.recovery import kept
    from tests.report.test_inplace_report import node_lost_in_place, restarted

    rows = [build_row(node_lost_in_place()), build_row(restarted(node_lost_in_place(), fell_back=False)),
            build_row(restarted(node_lost_in_place(), fell_back=True))]
    records = [kept.of_fault(r.recovered_how) for r in rows]
    assert [(r["way"], r["survivors"], r["survivors_kept"], r["fell_back"]) for r in records] == [
        ("in place", 1, 1, False), ("restart", 1, 0, False), ("restart", 1, 0, True)]
    assert records[0]["in_place_phases"]["reform"] == pytest.approx(0.05)
    t = kept.tally(records[:1])
    assert (t["in_place"], t["survivors"], t["survivors_kept"], t["every_survivor_kept"], t["fell_back"]) == (
        1, 1, 1, True, 0)
    t = kept.tally([*records, kept.of_fault(None)])
    assert (t["faults"], t["in_place"], t["restarted"], t["not_recovered"], t["fell_back"]) == (4, 1, 2, 1, 1)
    assert (t["survivors"], t["survivors_kept"], t["modes"]) == (3, 1, ["repoint"])
    assert kept.tally(records[1:])["every_survivor_kept"] is None, "no fault in place: nothing to judge"


def build_row(events):
    from elastic_harness.report.timeline import build

    (row,) = build(events).faults
    return row


def in_place_rows(medians: dict, cpu: dict, kept_all: bool = True) -> dict:
    """``bench_in_place``'s rows from medians per (size, side), same host only."""
    def row(n, side):
        return {"median_s": medians[(n, side)], "cpu_s_median": cpu[(n, side)],
                "kept": {"faults": 1, "survivors": n - 1, "survivors_kept": n - 1 if kept_all or side != "in_place"
                         else 0, "every_survivor_kept": kept_all if side == "in_place" else None,
                         "fell_back": 0 if kept_all or side != "in_place" else 1, "not_recovered": 0}}
    return {str(n): {"same_host": {side: row(n, side) for side in ("in_place", "restart")},
                     "separate_hosts": {"skipped": "needs root"}} for n in (2, 4, 8)}


def test_the_in_place_bench_judges_its_goals_on_the_medians():
    from elastic_harness.bench.recovery import inplace

    medians = {(2, "in_place"): 0.05, (4, "in_place"): 0.06, (8, "in_place"): 0.07,
               (2, "restart"): 0.10, (4, "restart"): 0.20, (8, "restart"): 0.40}
    cpu = {(2, "in_place"): 0.02, (4, "in_place"): 0.03, (8, "in_place"): 0.05,
           (2, "restart"): 0.1, (4, "restart"): 0.3, (8, "restart"): 0.5}
    rows = in_place_rows(medians, cpu)
    ratios = inplace.scaling(rows, [2, 4, 8])
    assert ratios["same_host_in_place"] == {"time": 1.4, "cpu_s": 2.5}
    assert ratios["same_host_restart"] == {"time": 4.0, "cpu_s": 5.0}
    assert ratios["separate_hosts_in_place"] == {"time": None, "cpu_s": None}
    out = inplace.goals(rows, ratios, [2, 4, 8])
    g = out["goals"]
    assert g["same_host_scaling"]["met"] is True and g["same_host_cpu_scaling"]["met"] is False
    assert g["same_host_two_nodes_s"] == {"value": 0.05, "goal": "<= 0.08", "met": True}
    assert g["separate_hosts_scaling"]["met"] is None and g["separate_hosts_scaling"]["skipped"] == "row skipped"
    assert g["every_survivor_kept"] == {"met": True, "survivors": 1 + 3 + 7, "kept": 11}
    assert g["no_fall_back"] == {"met": True, "fell_back": 0, "faults": 3}
    assert out["met"] is False and "separate_hosts_scaling" in out["not_judged"]
    lost = inplace.goals(in_place_rows(medians, cpu, kept_all=False), ratios, [2, 4, 8])["goals"]
    assert lost["every_survivor_kept"]["met"] is False and lost["no_fall_back"]["fell_back"] == 3


def test_the_in_place_bench_says_why_a_goal_was_not_judged():
    from elastic_harness.bench.recovery import inplace

    rows = {k: v for k, v in in_place_rows({(n, s): 0.1 for n in (2, 4, 8) for s in ("in_place", "restart")},
                                           {(n, s): 0.1 for n in (2, 4, 8) for s in ("in_place", "restart")}).items()
            if k in ("2", "4")}
    out = inplace.goals(rows, inplace.scaling(rows, [2, 4]), [2, 4])["goals"]
    assert out["same_host_scaling"]["met"] is None and "2 and 8" in out["same_host_scaling"]["skipped"]
    assert out["same_host_two_nodes_s"]["met"] is False  # 0.1 s at 2 nodes: judged, not met
    assert inplace.parse_sizes("8, 2,4,2") == [2, 4, 8]
    for bad in ("1,2", "two", ""):
        with pytest.raises(ValueError, match="--sizes"):
            inplace.parse_sizes(bad)
    assert inplace.order(0) == ("in_place", "restart") and inplace.order(1) == ("restart", "in_place")


def test_a_crash_summary_says_how_each_crash_was_recovered_and_who_kept_its_process():
    """``bench recovery --only kill-worker``'s summary of one run: each crash's way and
    survivors kept (``recoveries``), summed (``kept``), and the median in-place phases."""
    from tests.report.test_inplace_report import node_lost_in_place, restarted

    def crash(events):
        for e in events:
            if e["event"] == "fault":
                e.update(kind="kill-worker", target=1)
        return events

    in_place = crash_stats.crash_summary(crash(node_lost_in_place()), 1, 0)
    assert in_place["kept"]["in_place"] == 1 and in_place["kept"]["every_survivor_kept"] is True
    assert in_place["median_in_place_phases_s"]["reform"] == pytest.approx(0.05)
    assert (in_place["recoveries"][0]["way"], in_place["recoveries"][0]["survivors_kept"]) == ("in place", 1)
    fell = crash_stats.crash_summary(crash(restarted(node_lost_in_place(), fell_back=True)), 1, 0)
    assert (fell["kept"]["in_place"], fell["kept"]["fell_back"], fell["kept"]["survivors_kept"]) == (0, 1, 0)
    assert fell["median_in_place_phases_s"]["reform"] is None


def test_an_in_place_row_keeps_runs_that_hit_a_smaller_world_out_of_its_medians():
    """Under load a node can miss the first rendezvous round: that run measured N-1 nodes."""
    from elastic_harness.bench.recovery import inplace

    def run(world, s):
        return {"recovery_s": s, "world_size_before": world, "cpu_s": s, "way": "in place", "survivors": world - 1,
                "survivors_kept": world - 1, "fell_back": False, "mode": "repoint"}

    row = inplace.row_at_size([run(4, 0.3), run(3, 0.1), run(4, 0.5)], 4)
    assert row["median_s"] == pytest.approx(0.4) and row["kept"]["survivors"] == 6
    assert row["not_at_size"]["world_sizes"] == [3] and len(row["not_at_size"]["runs"]) == 1
    assert "not_at_size" not in inplace.row_at_size([run(4, 0.3)], 4)
