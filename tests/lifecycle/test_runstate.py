"""The one fold of the event log (``runstate``, ``goodput``): pure, on recorded event lists.

``tests/report/test_report.py`` checks the goodput figures by hand on its synthetic runs; here the
same fold is fed one event at a time, as the agent endpoint and the progress line feed it.
"""

from __future__ import annotations

import io

import pytest

from elastic_harness.commands.support.progress import Progress
from elastic_harness.records.goodput import BADPUT_KINDS, GoodputLedger
from elastic_harness.records.runstate import RunState, fold
from elastic_harness.records.summary import summarize
from elastic_harness.report.timeline import build
from tests.report.test_report import ev, killed_worker_run, steps


def adds_up(ledger_or_state, now=None) -> None:
    g = ledger_or_state.goodput(now)
    assert g.productive_s + sum(g.badput.values()) == pytest.approx(g.wall_s, abs=1e-3)
    assert set(g.badput) == set(BADPUT_KINDS) and min(g.badput.values()) >= -1e-9


def test_live_fold_adds_up_at_every_event_and_ends_where_the_report_does():
    events = killed_worker_run()
    live = GoodputLedger()
    for e in events:
        live.update(e)
        adds_up(live)
        adds_up(live, now=e["t"] + 5.0)  # a reader asking later: the open tail grows
    assert live.goodput() == build(events).goodput
    assert live.goodput(now=25.0).wall_s == pytest.approx(25.0)


def test_resuming_from_an_older_checkpoint_loses_every_step_past_it():
    """A trains 1..25 (1 s/step from t=10), B resumes from 20 and trains 21..30, then C falls
    back to the checkpoint at 15 and trains 16..20: only A's 1..15 and C's steps remain."""
    events = [
        ev(0.0, "start", 99, who="host"),
        ev(10.0, "resume", 10, fresh=True, step=0),
        *steps(10, 1, 25, 10.0, 1.0),  # t = 11..35
        ev(40.0, "resume", 20, step=20),
        *steps(20, 21, 30, 40.0, 1.0),  # t = 41..50
        ev(60.0, "resume", 30, step=15),
        *steps(30, 16, 20, 60.0, 1.0),  # t = 61..65
        ev(66.0, "exit", 99, who="host", code=0),
    ]
    g = fold(events).goodput()
    assert g.productive_s == pytest.approx(15.0 + 5.0)
    assert g.badput["lost_work"] == pytest.approx(10.0 + 10.0)
    adds_up(fold(events))
    kept = sorted(p.step for p in build(events).points if p.in_lineage)
    assert kept == list(range(1, 21)), "the report's lineage agrees: A's 1..15, C's 16..20"


def test_a_late_async_checkpoint_is_charged_to_the_span_after_its_step():
    events = [
        ev(0.0, "start", 99, who="host"),
        ev(1.0, "resume", 10, fresh=True, step=0),
        *steps(10, 1, 5, 1.0, 1.0),  # t = 2..6
        ev(6.5, "checkpoint", 10, step=2, blocking_s=0.3, asynchronous=True),
        ev(7.0, "checkpoint", 10, step=5, blocking_s=0.2),
        ev(8.0, "exit", 99, who="host", code=0),
    ]
    g = fold(events).goodput()
    assert g.badput["checkpoint_blocking"] == pytest.approx(0.5)
    assert g.productive_s == pytest.approx(5.0 - 0.3)
    assert g.badput["shutdown"] == pytest.approx(2.0 - 0.2)


def two_node_run() -> list[dict]:
    """Nodes 0 and 1 train 1..12; rank 1 (node 1) is killed; node 0 alone resumes from 10."""
    return [
        ev(0.0, "start", 99, who="host"),
        ev(1.0, "worker", 10, rank=0, local_rank=0, node="0"),
        ev(1.0, "worker", 11, rank=1, local_rank=0, node="1"),
        ev(1.1, "rendezvous", 10, world_size=2),
        ev(2.0, "resume", 10, step=4, world_size=2),  # resumed from an earlier invocation's save
        *steps(10, 5, 12, 2.0, 0.1),
        ev(3.0, "fault", 11, kind="kill-worker", target=1, step=12, rank=1, node="1"),
        ev(4.0, "worker", 20, rank=0, local_rank=0, node="0"),
        ev(4.1, "rendezvous", 20, world_size=1),
        ev(4.5, "resume", 20, step=10, world_size=1),
        *steps(20, 11, 14, 4.5, 0.1, world_size=1),
        ev(5.0, "finish", 20, step=14, loss=0.5),
    ]


def test_restarts_steps_and_faults_are_counted_one_way():
    job = fold(two_node_run())
    assert (job.generations, job.restarts, job.step, job.world_sizes) == (2, 1, 14, [2, 1])
    assert job.steps_done == 8 + 4, "redone steps 11 and 12 count: a counter only goes up"
    assert (job.faults, job.resumed_from_step, job.finished) == (1, 4, True)
    node1 = fold(two_node_run(), node="1")
    assert (node1.restarts, node1.faults) == (0, 1), "node 1 was in one group, and was hit once"
    node0 = fold(two_node_run(), node="0")
    assert (node0.generations, node0.restarts, node0.faults) == (2, 1, 0)


def test_progress_line_and_summary_count_restarts_alike():
    """A run that starts by resuming a checkpoint, then restarts once: restarts 1 both ways
    (the bar used to count the first, non-fresh resume as a restart too)."""
    events = [dict(e, samples_per_s=100.0) if e["event"] == "step" else e for e in two_node_run()]
    out = io.StringIO()
    bar = Progress(total_steps=14, out=out)
    for e in events:
        bar.update(e)
    bars = [line for line in out.getvalue().splitlines() if line.startswith("[")]
    assert "restarts 0" in bars[0] and "restarts 1" in bars[-1]
    summary = summarize(events)
    assert summary["restarts"] == bar.state.restarts == 1
    assert summary["steps"] == 14 and summary["goodput"] == build(events).goodput.__dict__


def test_a_reader_started_mid_run_counts_only_what_it_saw():
    events = two_node_run()
    late = RunState(node="0")
    for e in events[events.index(next(e for e in events if e["event"] == "fault")):]:
        late.update(e)
    assert (late.generations, late.restarts, late.steps_done, late.step) == (1, 0, 4, 14)
    adds_up(late)


def test_drains_and_agent_exits_are_kept_for_the_hosts_verdict():
    state = fold([
        {"event": "start", "who": "host", "t": 0.0},
        {"event": "drain", "step": 5, "t": 1.0},
        {"event": "exit", "who": "agent", "code": 143, "message": "agent received SIGTERM", "t": 1.1},
        {"event": "exit", "who": "agent", "code": 0, "t": 1.2},
        {"event": "exit", "who": "host", "code": 143, "t": 1.3},  # not an agent's
    ])
    assert state.drained_at == 5
    assert state.agent_exits == [(143, "agent received SIGTERM"), (0, "")]


def test_progress_folds_saves_into_the_line_and_prints_only_the_unusual():
    """A save every 10 steps is no line of its own: the bar says the last saved step, a slow
    save (training held up over a second) gets a line, and the end tallies the saves."""
    out = io.StringIO()
    bar = Progress(total_steps=100, out=out)
    bar.update({"event": "resume", "fresh": True, "step": 0, "t": 0.0})
    bar.update({"event": "memory", "step": 1, "every": 1, "t": 0.1})  # unmeasured: not shown
    for step in range(1, 101):
        bar.update({"event": "step", "step": step, "loss": 1.0, "world_size": 2, "t": step / 10})
        if step % 10 == 0:
            bar.update({"event": "checkpoint", "step": step, "asynchronous": True, "t": step / 10,
                        "blocking_s": 1.7 if step == 50 else 0.01, "total_s": 0.3})
        if step in (20, 40):  # a memory probe's off block, then the same interval again
            bar.update({"event": "memory", "step": step, "every": 0, "copy_s": 0.002,
                        "step_s": 0.04, "t": step / 10})
        if step in (5, 30, 60, 75):
            bar.update({"event": "memory", "step": step, "every": 2, "copy_s": 0.002,
                        "step_s": 0.04, "t": step / 10})
        if step == 70:  # a change that reverts within a few steps is not shown
            bar.update({"event": "memory", "step": step, "every": 3, "copy_s": 0.003,
                        "step_s": 0.04, "t": step / 10})
    bar.close()
    lines = out.getvalue().splitlines()
    assert not any(line.startswith("checkpoint step") and "step 50 " not in line for line in lines)
    assert any(line.startswith("checkpoint step 50 held training up 1.70 s") for line in lines)
    assert [line for line in lines if "in-memory" in line] == [
        "in-memory snapshots every 2 step(s) from step 5 (a copy takes 2.0 ms, a step 40.0 ms)"]
    bars = [line for line in lines if line.startswith("[")]
    assert len(bars) <= 11 and bars[-1].endswith("saved 90")  # step 100 is saved after its step line
    assert lines[-1] == "checkpoints: 10 saved (async), last step 100, training blocked 0.01-1.70 s each"


def test_only_this_invocations_agents_exits_decide_its_outcome():
    """A submission whose lock this one took over (issue 42) shares the log while it stops:
    its agent's exit (2, "lost the lock") is not this job's, which used to end with it."""
    state = RunState()
    for e in [{"t": 1.0, "event": "start", "who": "host", "run_id": "b", "pid": 10},
              {"t": 2.0, "event": "start", "who": "agent", "run_id": "b", "pid": 11},
              {"t": 3.0, "event": "exit", "who": "agent", "pid": 5, "code": 2, "message": "lost the lock"},
              {"t": 4.0, "event": "exit", "who": "agent", "pid": 11, "code": 143, "message": "SIGTERM"}]:
        state.update(e)
    assert state.agent_exits == [(143, "SIGTERM")]
    slurm = RunState()  # agents without a host ``run`` (Slurm, Kubernetes): every agent is the job's
    slurm.update({"t": 1.0, "event": "exit", "who": "agent", "pid": 5, "code": 0})
    assert slurm.agent_exits == [(0, "")]
