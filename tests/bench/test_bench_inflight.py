"""``bench inflight``: the analysis of both sides on hand-made logs (no runs, no torchft)."""

from __future__ import annotations

import argparse

import pytest

from elastic_harness.bench.inflight import harness_side, torchft_stats
from elastic_harness.bench.inflight import main as inflight
from elastic_harness.bench.inflight.torchft_run import Config, check

pytestmark = pytest.mark.timeout(60)

G = 4  # global batch of the hand-made harness runs: 2 ranks x 2 samples, micro-batches of 1


# --- torchft's side ---------------------------------------------------------------------------

FT = Config(groups=2, steps=4, kill_group=1, kill_at_step=2)


def attempt(group, step, t, committed=True, participating=True, samples=15, mb=2):
    return {"group": group, "step": step, "t0": t - 0.01, "t": t, "committed": committed,
            "participating": participating, "samples": samples, "micro_batches": mb, "participants": 2}


def kill(t, step=2, where="after_step"):
    return {"event": "kill", "t": t, "step": step, "kill_point": where}


def two_steps_together():
    return [attempt(0, 1, 1.0), attempt(1, 1, 1.0), attempt(0, 2, 1.1), attempt(1, 2, 1.1)]


def test_torchft_loss_after_a_step_keeps_every_step_but_shrinks_the_batch():
    records = [*two_steps_together(), kill(1.11), attempt(0, 3, 6.1), attempt(0, 4, 6.2)]
    out = torchft_stats.analyze(records, FT, [(1.12, "Quorum status: New quorum not ready"),
                                              (6.09, "Detected quorum change, bumping quorum_id to 2")])
    assert (out["discarded_micro_batches"], out["steps_redone"]) == (0, 0)
    assert out["longest_gap_s"] == 5.0 and out["longest_gap_between_steps"] == [2, 3]
    assert out["median_step_s"] == 0.1
    assert out["global_batch_held"] is False and out["short_steps_samples"] == ["3-4: 15"]
    assert out["fault"]["healthy_first_commit_step"] == 3 and out["fault"]["new_quorum_after_s"] == 4.98
    assert out["completed"] is True


def test_torchft_loss_inside_a_step_discards_it_on_the_healthy_group_and_redoes_it():
    records = [*two_steps_together(), kill(1.15, 3, "in_step"),
               attempt(0, 3, 1.2, committed=False), attempt(0, 3, 6.2), attempt(0, 4, 6.3)]
    out = torchft_stats.analyze(records, FT, [])
    assert (out["discarded_micro_batches"], out["discarded_samples"], out["steps_redone"]) == (2, 15, 1)
    assert out["per_group"][0]["refused_steps"] == [3]
    assert out["fault"]["healthy_first_commit_step"] == 3


def test_a_torchft_step_without_every_share_is_not_the_global_batch():
    records = [*two_steps_together(), attempt(0, 3, 1.2), attempt(1, 3, 1.2, participating=False),
               attempt(0, 4, 1.3), attempt(1, 4, 1.3)]
    out = torchft_stats.analyze(records, Config(groups=2, steps=4, kill_group=1, kill_at_step=3,
                                                global_batch=30), [])
    assert out["short_steps_samples"] == ["3: 15"] and not out["global_batch_held"]


def test_a_torchft_crash_gives_no_figures():
    out = torchft_stats.analyze([*two_steps_together(), kill(1.15, 3, "in_step")], FT, [])
    assert out["completed"] is False and out["steps_never_committed"] == ["3-4: 0"]
    row = torchft_stats.row(out, "a process crashed")
    assert row["longest_gap_s"] is None and row["global_batch_held"] is False


@pytest.mark.parametrize("bad", [dict(groups=1), dict(kill_group=2), dict(kill_at_step=4), dict(kill_point="x")])
def test_torchft_settings_that_cannot_run_are_refused(bad):
    with pytest.raises(ValueError):
        check(Config(**{**dict(groups=2, steps=4, kill_group=1, kill_at_step=2), **bad}))


# --- the harness's side -----------------------------------------------------------------------


def event(kind, t, **kw):
    return {"event": kind, "t": t, **kw}


def start_of_run():
    """2 nodes of 1 rank (rank 1 on node 1, pid 11), generation "a"."""
    return [event("worker", 0.0, pid=10, rank=0, node="0", restart=0),
            event("worker", 0.0, pid=11, rank=1, node="1", restart=0),
            event("rendezvous", 0.0, pid=10, generation="a", restart=0, world_size=2)]


def steps_at(pid, *pairs):
    return [event("step", t, pid=pid, step=s) for s, t in pairs]


def record(gen, step, rank, positions, t_ns, dp_size=2):
    return {"generation": gen, "step": step, "rank": rank, "dp_size": dp_size, "positions": positions,
            "t_ns": t_ns}


def whole(step, gen="a", t_ns=0):
    """Both ranks' records of ``step`` in generation ``gen``: the global batch, shared."""
    lo = (step - 1) * G
    return [record(gen, step, 0, [lo, lo + 1], t_ns), record(gen, step, 1, [lo + 2, lo + 3], t_ns)]


def loss_after_step_2(finished):
    """Node 1 dies after step 2; the survivor (rank 0, pid 10) had recorded step 3 and goes on
    alone in generation "b": step 3 finished in place (``finished``) or redone from its start."""
    events = [*start_of_run(), *steps_at(10, (1, 1.0), (2, 1.1)), event("fault", 1.12, target=1, step=2),
              event("rendezvous", 1.2, pid=10, generation="b", restart=1, world_size=1),
              *([event("finished", 1.25, step=3, lost_dp_ranks=[1])] if finished else []),
              *steps_at(10, (3, 1.3), (4, 1.35))]
    records = [*whole(1, t_ns=1), *whole(2, t_ns=2), record("a", 3, 0, [8, 9], 3),
               record("b", 3, 0, [8, 9, 10, 11], 4, dp_size=1), record("b", 4, 0, [12, 13, 14, 15], 5, dp_size=1)]
    return events, records


def analyze_harness(events, records):
    return harness_side.analyze(events, records, steps=4, global_batch=G, micro_batch=1)


def test_harness_step_finished_in_place_discards_nothing_and_holds_the_batch():
    out = analyze_harness(*loss_after_step_2(finished=True))
    assert (out["discarded_micro_batches"], out["steps_redone"], out["finished_in_place"]) == (0, 0, [3])
    assert out["global_batch_held"] and out["completed"]
    assert out["longest_gap_s"] == 0.2 and out["longest_gap_between_steps"] == [2, 3]
    assert out["median_step_s"] == 0.1


def test_a_stall_away_from_the_loss_is_not_the_loss_gap_but_is_reported_beside_it():
    """A save's wait or a scheduling stall three steps later is longer than the loss's gap: the
    goal's figure stays the loss's (the gap the fault falls in and the next), the whole run's is
    beside it; without a fault there is no loss gap."""
    events, records = loss_after_step_2(finished=True)
    events += steps_at(10, (5, 1.4), (6, 2.4))
    out = analyze_harness(events, records)
    assert (out["longest_gap_s"], out["longest_gap_between_steps"]) == (0.2, [2, 3])
    assert (out["longest_gap_anywhere_s"], out["longest_gap_anywhere_between_steps"]) == (1.0, [5, 6])
    no_fault = [e for e in events if e["event"] != "fault"]
    assert harness_side.gap_figures(no_fault, set())["longest_gap_s"] is None


def test_torchft_loss_gap_is_each_healthy_groups_own():
    """Three groups, group 1 killed: each healthy group's gap around the fault counts (group 2's
    is the longer), not a stall of group 0's later on."""
    records = [attempt(g, s, t) for s, t in ((1, 1.0), (2, 1.1)) for g in (0, 1, 2)]
    records += [kill(1.11), attempt(0, 3, 1.5), attempt(2, 3, 2.0), attempt(0, 4, 1.6), attempt(2, 4, 2.1),
                attempt(0, 5, 9.0), attempt(2, 5, 2.2)]
    out = torchft_stats.analyze(records, Config(groups=3, steps=5, kill_group=1, kill_at_step=2), [])
    assert (out["longest_gap_s"], out["longest_gap_between_steps"]) == (0.9, [2, 3])
    assert out["longest_gap_anywhere_s"] == 7.4


def test_harness_step_redone_counts_the_survivors_micro_batches_only():
    events, records = loss_after_step_2(finished=False)
    records.insert(3, record("a", 3, 1, [10, 11], 3))  # the lost rank had started it too: not healthy
    out = analyze_harness(events, records)
    assert (out["steps_redone"], out["redone_steps"], out["discarded_micro_batches"]) == (1, [3], 2)


def test_harness_step_short_of_the_global_batch_is_reported():
    events, records = loss_after_step_2(finished=True)
    records[-1] = record("b", 4, 0, [12, 13, 14], 5, dp_size=1)  # one sample of step 4 missing
    out = analyze_harness(events, records)
    assert not out["global_batch_held"] and out["steps_not_whole"] == [4]


def test_harness_run_without_a_fault_has_no_lost_ranks():
    events = [*start_of_run(), *steps_at(10, (1, 1.0), (2, 1.1))]
    out = harness_side.analyze(events, [*whole(1), *whole(2)], steps=2, global_batch=G, micro_batch=1)
    assert (out["discarded_micro_batches"], out["steps_redone"], out["global_batch_held"]) == (0, 0, True)


def test_fault_specs_name_the_step_and_the_phase():
    assert harness_side.fault_spec(40, in_step=False) == "kill-node:1@40"
    assert harness_side.fault_spec(40, in_step=True) == "kill-node:1@40+reduction"


# --- the bench's summary ----------------------------------------------------------------------


def harness_row(gap, step, discarded=0, redone=0, held=True):
    return {"row": {"verdict": "completed", "discarded_micro_batches": discarded, "longest_gap_s": gap,
                    "median_step_s": step, "steps_redone": redone, "global_batch_held": held}, "load": 1.0}


def test_goals_are_judged_on_the_medians():
    runs = {"harness": [harness_row(0.05, 0.01), harness_row(0.06, 0.01), harness_row(0.5, 0.01, redone=1)]}
    report = inflight.summarize(runs, {"harness": None, "torchft": "torchft is not installed here"})
    assert report["rows"]["harness"]["longest_gap_s"] == 0.06 and report["rows"]["harness"]["steps_redone"] == 0
    assert report["goals"]["gap_bound_s"] == 0.07 and report["goals"]["all"] is True
    assert report["rows"]["torchft"] == {"skipped": "torchft is not installed here"}


def test_a_gap_over_two_steps_and_50_ms_misses_the_goal():
    report = inflight.summarize({"harness": [harness_row(0.08, 0.01)]}, {"harness": None})
    assert report["goals"]["gap_within_bound"] is False and report["goals"]["all"] is False


def test_one_run_short_of_the_batch_fails_the_batch_goal():
    runs = {"harness": [harness_row(0.05, 0.01), harness_row(0.05, 0.01, held=False)]}
    assert inflight.summarize(runs, {"harness": None})["goals"]["global_batch_held"] is False


def test_without_torchft_its_sides_are_skipped_with_the_install_line(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft now raises ImportError
    sides = inflight.sides_to_run(in_step=True)
    assert sides["harness"] is None and set(sides) == {"harness", "torchft", "torchft_patched"}
    assert "pip install torchft==0.2.0" in sides["torchft"]


def test_bad_repeats_are_refused_before_anything_runs(tmp_path):
    from elastic_harness.errors import HarnessError

    args = argparse.Namespace(repeats=0, timeout=300.0, out=None, in_step=False, dir=str(tmp_path))
    with pytest.raises(HarnessError):
        inflight.cmd_inflight(args)
    assert list(tmp_path.iterdir()) == []


def test_harness_fault_is_timed_to_the_reformation_the_finish_and_the_next_step():
    events, records = loss_after_step_2(finished=True)
    phases = {"leave": 0.01, "park": 0.02, "reform": 0.01}
    events.insert(-2, event("reformed", 1.18, pid=10, rank=0, mode="finish", phases_s=phases))
    next(e for e in events if e["event"] == "finished")["phases_s"] = {"repoint": 0.01, "extra": 0.02, "reduce": 0.0}
    fault = analyze_harness(events, records)["fault"]
    assert (fault["to_reformed_s"], fault["to_finished_s"], fault["to_next_step_s"]) == (0.06, 0.13, 0.18)
    assert fault["reformed_phases_s"] == phases
    assert fault["finished_phases_s"] == {"repoint": 0.01, "extra": 0.02, "reduce": 0.0}
    # the re-formation less its consecutive phases: the break noticed, the place had
    assert (fault["to_detected_s"], fault["to_placed_s"]) == (0.02, 0.05)


def test_harness_fault_without_a_reformation_has_no_detection_or_place():
    fault = analyze_harness(*loss_after_step_2(finished=True))["fault"]
    assert fault["to_detected_s"] is fault["to_placed_s"] is fault["finished_phases_s"] is None
    assert fault["to_finished_s"] == 0.13
