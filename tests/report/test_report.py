"""``report`` and ``verify``: the pure timeline on synthetic events, then one real faulted run.

The synthetic runs are written with round numbers so every figure can be checked by hand;
the module doc of ``elastic_harness.report.timeline`` defines each term.
"""

from __future__ import annotations

import json
import shutil

import pytest

from elastic_harness.cli import main
from elastic_harness.commands.report import load_timeline, render
from elastic_harness.report.timeline import BADPUT_KINDS, build, split_invocations
from tests.conftest import MLP, cli, final_ckpt

REACT = "dynamic_rendezvous.py:DynamicRendezvousHandler.next_rendezvous"
COMPLETE = "dynamic_rendezvous.py:_DistributedRendezvousOpExecutor._mark_rendezvous_complete"


def ev(t: float, event: str, pid: int = 1, **fields) -> dict:
    return {"t": t, "event": event, "pid": pid, **fields}


def steps(pid: int, first: int, last: int, t: float, dt: float, world_size: int = 2, every: int = 1) -> list[dict]:
    """Step events first..last (every ``every``), the first one ``dt`` after ``t``."""
    return [ev(t + dt * (s - first + 1), "step", pid, step=s, loss=1.0 / s, world_size=world_size)
            for s in range(first, last + 1) if s % every == 0 or s == last]


def killed_worker_run() -> list[dict]:
    """Host at 0; generation A (pid 10) trains 1..25 from t=10 at 0.1 s/step, saving at 10
    and 20 (0.05 s blocking each); rank 1 is killed after step 25; the agent reacts at 12.7,
    the rendezvous completes at 13.0; generation B (pid 20) loads step 20 at 17.0 and trains
    21..30, saves 30 (0.2 s blocking), finishes; the host exits at 19.0."""
    return [
        ev(0.0, "start", 99, who="host"),
        ev(9.0, "rendezvous", 10, world_size=2, restart=0),
        ev(10.0, "resume", 10, fresh=True, step=0, world_size=2),
        *steps(10, 1, 25, 10.0, 0.1),
        ev(11.2, "checkpoint", 10, step=10, blocking_s=0.05),
        ev(12.2, "checkpoint", 10, step=20, blocking_s=0.05),
        ev(12.55, "fault", 11, kind="kill-worker", target=1, step=25, rank=1),
        ev(12.7, "torchelastic", 5, name=REACT, message="The node 'n' attempts to join the next round"),
        ev(13.0, "torchelastic", 5, name=COMPLETE, state="SUCCEEDED", message="marked round 1 complete"),
        ev(16.5, "rendezvous", 20, world_size=2, restart=1),
        ev(17.0, "resume", 20, step=20, world_size=2, load_s=0.3, source="storage"),
        *steps(20, 21, 30, 17.0, 0.1),
        ev(18.1, "checkpoint", 20, step=30, blocking_s=0.2),
        ev(18.2, "finish", 20, step=30),
        ev(19.0, "exit", 99, who="host", code=0),
    ]


def test_fault_row_times_in_order_and_steps_lost():
    tl = build(killed_worker_run())
    (f,) = tl.faults
    assert (f.kind, f.target, f.step, f.resumed_from, f.steps_lost, f.graceful) == ("kill-worker", 1, 25, 20, 5, False)
    assert f.source == "storage"  # the resume event's source: the report shows it
    assert f.t == pytest.approx(12.55)
    assert (f.detected, f.rendezvous, f.loaded, f.first_step) == pytest.approx((12.7, 13.0, 17.0, 17.1))
    assert f.t < f.detected < f.rendezvous < f.loaded < f.first_step
    assert f.recovery_s == pytest.approx(17.1 - 12.55)
    assert (f.world_size_before, f.world_size_after, f.load_s) == (2, 2, 0.3)


def account(t, pid, rank, message, **fields):
    """An agent's account of a failed worker group (``agent.elastic.exit_account``)."""
    return ev(t, "failure", pid, cause="exit", fatal=False, rank=rank, message=message, **fields)


def outside_failures_run() -> list[dict]:
    """Nothing injected but the last: rank 1 SIGKILLed from outside after step 10 (both
    agents give an account), a frozen rank 0 killed by the watchdog after step 20, then an
    injected kill-worker after step 30 (its agent's account belongs to that fault's row)."""
    events = [ev(0.0, "start", 99, who="host"), ev(1.0, "resume", 10, fresh=True, step=0, world_size=2)]
    events += steps(10, 1, 10, 1.0, 0.1)
    events += [ev(2.05, "failure", 10, rank=0, peer_lost=True, message="RuntimeError: Connection reset by peer"),
               account(2.1, 5, 1, "rank 1 (pid 11) was killed by SIGKILL; then rank 0 stopped (SIGTERM)",
                       signal="SIGKILL", recorded=False, step=10),
               account(2.12, 6, 2, "rank 2 (pid 12) lost its peers (Connection reset by peer)", peer_lost=True,
                       recorded=True, step=10),
               ev(3.0, "resume", 20, step=8, world_size=2, source="storage")]
    events += steps(20, 9, 20, 3.0, 0.1)
    events += [ev(9.0, "failure", 5, cause="hang", rank=0, step=20, message="rank 0 hung (it was stopped by a signal)"),
               account(9.1, 5, 0, "rank 0 (pid 20) was killed by SIGKILL", signal="SIGKILL", recorded=False, step=20),
               ev(10.0, "resume", 30, step=20, world_size=2, source="memory")]
    events += steps(30, 21, 30, 10.0, 0.1)
    events += [ev(11.05, "fault", 31, kind="kill-worker", target=1, step=30, rank=1),
               account(11.1, 5, 1, "rank 1 (pid 31) was killed by SIGKILL", signal="SIGKILL", recorded=False, step=30),
               ev(12.0, "resume", 40, step=25, world_size=2, source="storage")]
    events += steps(40, 26, 40, 12.0, 0.1)
    return events + [ev(14.0, "finish", 40, step=40), ev(14.5, "exit", 99, who="host", code=0)]


def test_every_failure_recovered_from_has_a_row_injected_or_not():
    """Issue 33: ``report`` said "no faults injected" after 37 external SIGKILLs and a
    SIGSTOP: it listed injected faults only."""
    from elastic_harness.commands.report import failure_count

    tl = build(outside_failures_run())
    rows = [(f.index, f.kind, f.target, f.step, f.resumed_from, f.steps_lost, f.injected, f.source) for f in tl.faults]
    assert rows == [(0, "SIGKILL", 1, 10, 8, 2, False, "storage"),   # both agents' accounts: one row
                    (1, "hang", 0, 20, 20, 0, False, "memory"),       # the watchdog's kill and its account: one
                    (2, "kill-worker", 1, 30, 25, 5, True, "storage")]  # the injected one's account is its own
    killed = tl.faults[0]
    assert killed.t == pytest.approx(2.05) and killed.detected == pytest.approx(2.1)  # the first sign, then the account
    assert killed.first_step == pytest.approx(3.1) and killed.cause.startswith("rank 1 (pid 11) was killed by SIGKILL")
    assert failure_count(tl.faults) == "3 failure(s): 1 injected, 2 not; 3 recovered (0 in place), 7 step(s) lost"
    text = "\n".join(render(tl, __import__("pathlib").Path("run")))
    assert "no faults injected" not in text and "3 failure(s): 1 injected, 2 not" in text
    assert "#0 not injected: rank 1 (pid 11) was killed by SIGKILL" in text


def test_a_node_added_is_a_fault_injected_but_no_failure():
    """A node killed, then a node added to keep a spare (issue 42's soak): ``report`` counted
    the ``add-node`` as a failure too. Both stay rows of the table; one is a failure."""
    from elastic_harness.commands.report import failure_count

    events = [ev(0.0, "start", 99, who="host"), ev(1.0, "resume", 10, fresh=True, step=0, world_size=2)]
    events += steps(10, 1, 10, 1.0, 0.1)
    events += [ev(2.05, "fault", 11, kind="kill-node", target=1, step=10, rank=1),
               account(2.1, 5, 0, "rank 0 (pid 10) lost its peers", peer_lost=True, recorded=True, step=10),
               ev(3.0, "resume", 20, step=10, world_size=2, source="peer")]
    events += steps(20, 11, 20, 3.0, 0.1)
    events += [ev(4.05, "fault", 99, kind="add-node", target=None),
               ev(4.5, "drain", 20, step=20, world_size=2, saved="memory"),
               account(4.6, 5, 0, "rank 0 (pid 20) exited with 143", exit_code=143, recorded=True, step=20),
               ev(5.0, "resume", 30, step=20, world_size=2, source="memory")]
    events += steps(30, 21, 30, 5.0, 0.1)
    tl = build(events + [ev(7.0, "finish", 30, step=30), ev(7.5, "exit", 99, who="host", code=0)])
    assert [f.kind for f in tl.faults] == ["kill-node", "add-node"]
    assert failure_count(tl.faults) == ("1 failure(s): 1 injected, 0 not; 1 recovered (0 in place), 0 step(s) lost; "
                                        "and 1 other fault(s) injected (add-node)")


def test_goodput_arithmetic_adds_up_to_wall_time():
    g = build(killed_worker_run()).goodput
    expected = {
        "startup": 10.0,  # host start -> first resume
        "rendezvous": 0.5,  # last step of A (12.5) -> rendezvous complete (13.0)
        "restart": 4.0,  # 13.0 -> B's resume (17.0)
        "checkpoint_blocking": 0.3,  # 0.05 + 0.05 + 0.2
        "lost_work": 0.45,  # steps 21..25 of A (0.5 s) less the step-20 save's blocking
        "shutdown": 0.8,  # last step (18.0) -> host exit (19.0), less the final save's blocking
        "hang_detection": 0.0,  # no watchdog kill
    }
    assert g.badput == pytest.approx(expected)
    assert g.productive_s == pytest.approx(1.95 + 1.0)  # A's steps 1..20 less one save, B's 21..30
    assert g.wall_s == pytest.approx(19.0)
    assert g.productive_s + sum(g.badput.values()) == pytest.approx(g.wall_s)
    assert g.goodput == pytest.approx(2.95 / 19.0, abs=1e-4)


def test_lineage_marks_redone_steps():
    tl = build(killed_worker_run())
    lost = sorted(p.step for p in tl.points if not p.in_lineage)
    assert lost == [21, 22, 23, 24, 25]
    assert sorted(p.step for p in tl.points if p.in_lineage) == list(range(1, 31))


def test_sparse_step_events_share_spans_by_lineage():
    """log_every=5: the span (10, 15] of A is 2/5 in the lineage when B resumes from 12."""
    events = [
        ev(0.0, "start", 99, who="host"),
        ev(1.0, "resume", 10, fresh=True, step=0),
        *steps(10, 1, 15, 1.0, 0.1, every=5),  # events at steps 5, 10, 15 (t = 1.5, 2.0, 2.5)
        ev(2.6, "fault", 11, kind="kill-worker", target=0, step=17, rank=0),
        ev(4.0, "resume", 20, step=12),
        *steps(20, 13, 20, 4.0, 0.1, every=5),  # steps 15, 20 (t = 4.3, 4.8)
        ev(5.0, "exit", 99, who="host", code=0),
    ]
    tl = build(events)
    g = tl.goodput
    assert g.productive_s == pytest.approx(1.0 + 0.5 * 0.4 + 0.8)
    assert g.badput["lost_work"] == pytest.approx(0.5 * 0.6)
    assert g.badput["restart"] + g.badput["rendezvous"] == pytest.approx(4.0 - 2.5)
    assert tl.faults[0].steps_lost == 5  # fault after 17, resumed from 12


def test_graceful_drain_loses_nothing_and_gap_between_invocations_is_not_wall_time():
    events = [
        ev(0.0, "start", 99, who="host"),
        ev(5.0, "resume", 10, fresh=True, step=0),
        *steps(10, 1, 6, 5.0, 0.5),  # step 6 at t=8.0
        ev(8.2, "fault", 99, kind="preempt", target=0, step=6),  # host-fired: no rank
        *steps(10, 7, 7, 8.0, 0.5),  # the step in flight finishes at 8.5
        ev(8.6, "checkpoint", 10, step=7, blocking_s=0.1),
        ev(8.7, "drain", 10, step=7),
        ev(9.0, "exit", 99, who="host", code=143),
        ev(100.0, "start", 98, who="host"),
        ev(103.0, "torchelastic", 6, name=COMPLETE, state="SUCCEEDED"),
        ev(105.0, "resume", 30, step=7),
        *steps(30, 8, 10, 105.0, 0.5),
        ev(107.0, "exit", 98, who="host", code=0),
    ]
    assert [len(p) for p in split_invocations(events)] == [13, 7]
    tl = build(events)
    (f,) = tl.faults
    assert f.graceful and f.step == 6 and f.resumed_from == 7 and f.steps_lost == 0
    assert f.detected == pytest.approx(8.7)  # the drain is how the job reacted
    assert f.loaded == pytest.approx(105.0) and f.first_step == pytest.approx(105.5)
    assert tl.invocations == 2 and tl.goodput.wall_s == pytest.approx(9.0 + 7.0)
    assert tl.goodput.badput["lost_work"] == 0
    assert tl.goodput.productive_s == pytest.approx(3.5 + 1.5)


def test_without_bridged_events_rendezvous_falls_back_to_the_workers():
    """Plain torchrun writes no torchelastic events: detection unknown, rendezvous from workers."""
    events = [e for e in killed_worker_run() if e["event"] != "torchelastic"]
    (f,) = build(events).faults
    assert f.detected is None
    assert f.rendezvous == pytest.approx(16.5) and f.loaded == pytest.approx(17.0)
    g = build(events).goodput
    assert g.badput["rendezvous"] == pytest.approx(16.5 - 12.5)


def test_no_events_and_no_faults():
    tl = build([])
    assert tl.faults == [] and tl.goodput.wall_s == 0 and tl.goodput.goodput == 0
    clean = [e for e in killed_worker_run() if e["event"] != "fault"]
    assert build(clean).faults == []
    assert set(build(clean).goodput.badput) == set(BADPUT_KINDS)


def test_report_and_verify_need_a_run_dir(tmp_path, capsys):
    # In-process through the CLI's own entry (what `python -m elastic_harness` calls).
    assert main(["report", str(tmp_path)]) == 2
    assert "no events.jsonl" in capsys.readouterr().err
    assert main(["verify", str(tmp_path), str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no complete checkpoint" in err and "fix:" in err and "Traceback" not in err


def not_events() -> list[bytes]:
    """Lines a log may hold that are not events: bytes, other JSON, and every field readers
    compute with in another shape."""
    from elastic_harness.events import FIELD_TYPES

    lines = [b"\xff\xfe not utf-8 \xc3\x28", b"{not json", b"[1, 2]", b"\"text\"", b"42", b"null",
             b'{"event": "step", "step": 3}', b'{"t": "soon", "event": "step", "step": 3}',
             b'{"t": 12.0, "event": 7}', b'{"t": NaN, "event": "step", "step": 3}',
             b'{"t": 12.0, "event": "finish"}', b'{"t": 12.0, "event": "step", "step": null, "loss": 1}']
    for kind in ("step", "resume", "failure", "torchelastic", "finish", "eval", "memory", "checkpoint",
                 "exit", "rendezvous", "worker", "drain", "fault", "start"):
        for name in FIELD_TYPES:
            for wrong in ([1], {"a": 1}, "x", 1.5):
                e = {"t": 12.0, "event": kind, "pid": 10, "step": 3, name: wrong}
                from elastic_harness.events import well_formed

                if well_formed(e):
                    lines.append(json.dumps(e).encode())
    return lines


def test_lines_that_are_not_events_are_skipped_counted_and_said_once(tmp_path, capsys):
    """Issue 33: one line of invalid UTF-8, or valid JSON of the wrong shape, crashed
    ``report``, ``status`` and the end of ``run``. Readers skip it, count it, say so once."""
    from elastic_harness.commands.support.progress import Progress
    from elastic_harness.events import read_events, skipped_notes
    from elastic_harness.lifecycle.state import JobStatus, Liveness, status_from_events
    from elastic_harness.records.runstate import fold
    from elastic_harness.records.summary import summarize

    good = killed_worker_run()
    bad = not_events()
    assert len(bad) > 300
    log = tmp_path / "events.jsonl"
    with log.open("wb") as f:
        for i, e in enumerate(good):
            f.write(json.dumps(e).encode() + b"\n")
            if i == 20:
                f.write(b"\n".join(bad) + b"\n")
    skipped_notes()
    events = read_events(log)
    assert events == good
    (note,) = skipped_notes()
    assert f"skipped {len(bad)} line(s) that are not events (first: line 22: not UTF-8)" in note
    assert skipped_notes() == []  # said once
    # What reads the log through the reader: the summary, the report's timeline, the
    # terminal's progress, a job's status.
    assert summarize(events)["steps"] == 30 and fold(events).finished
    assert build(events).faults
    with (tmp_path / "progress.txt").open("w") as out:
        progress = Progress(30, out=out)
        for e in events:
            progress.update(e)
    base = JobStatus(id="j", name="n", scheduler="local", state="pending", run_dir=str(tmp_path), total_steps=30)
    status_from_events(base, events, Liveness("gone", 0), None, 20.0)
    capsys.readouterr()
    assert main(["report", str(tmp_path), "--no-plot"]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err and err.count("warning:") == 1 and "skipped" in err, err
    assert "goodput" in out


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_report_and_verify_on_a_killed_worker_run(mlp_reference, tmp_path):
    # Synchronous saves: step 20's checkpoint is complete before step 21 starts, so the
    # resume point does not depend on how fast a background save finished. No memory tier:
    # the report's lost-step accounting is shown on a storage restore (memory loses none;
    # tests/memtier/test_e2e_memory.py).
    run_dir = tmp_path / "killed"
    r = cli("run", str(MLP), "--chaos", "kill-worker:1@25", "--set", "checkpoint.async_save=false",
            "--set", "checkpoint.memory_every=0", run_dir=run_dir, timeout=200)
    assert r.code == 0, r.err
    rep = cli("report", str(run_dir), "--json", timeout=120)
    assert rep.code == 0, rep.err
    data = json.loads(rep.out)
    (f,) = data["faults"]
    assert (f["kind"], f["target"], f["step"], f["resumed_from"], f["steps_lost"]) == ("kill-worker", 1, 25, 20, 5)
    times = [f["t"], f["detected"], f["rendezvous"], f["loaded"], f["first_step"]]
    assert None not in times and times == sorted(times), times
    g = data["goodput"]
    assert 0 < g["goodput"] < 1
    assert g["productive_s"] + sum(g["badput"].values()) == pytest.approx(g["wall_s"], abs=1e-3)
    assert r.summary["goodput"] == g, "summary.json and report count goodput one way"
    png = run_dir / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The table is rendered from the same timeline the JSON came from (in-process: no second
    # command start-up just to print it).
    text = "\n".join(render(load_timeline(run_dir), run_dir))
    assert "kill-worker" in text and "goodput" in text

    same = cli("verify", str(run_dir), str(mlp_reference.run_dir), timeout=120)
    assert same.code == 0, same.err
    assert "bit-identical" in same.out

    # Another model without another run: the same run dir without its final checkpoint.
    other = tmp_path / "earlier"
    shutil.copytree(run_dir / "checkpoints", other / "checkpoints")
    shutil.copy2(run_dir / "job.key", other / "job.key")  # signed with it: verify reads it first
    shutil.rmtree(final_ckpt(other))
    differs = cli("verify", str(other), str(mlp_reference.run_dir), timeout=120)
    assert differs.code == 1, differs.out + differs.err
    assert "max abs" in differs.out and "OUTSIDE" in differs.out


def test_evaluations_are_in_the_timeline_and_the_plot(tmp_path):
    from elastic_harness.report.plot import draw

    events = killed_worker_run()
    events.insert(-3, ev(18.15, "eval", 20, step=30, metrics={"loss": 0.5, "accuracy": 0.75}, eval_s=0.1))
    tl = build(events)
    assert [(round(e.t, 2), e.step, e.metrics["accuracy"]) for e in tl.evals] == [(18.15, 30, 0.75)]
    path = draw(tl, tmp_path / "report.png")
    assert path.stat().st_size > 0 and path.read_bytes()[:4] == b"\x89PNG"


def test_plot_keeps_fault_labels_off_the_data_and_draws_a_smoothed_loss(tmp_path):
    from elastic_harness.report.plot import figure, label_rows, smooth

    assert smooth([1.0, 2.0, 3.0, 4.0, 5.0], 3) == [1.5, 2.0, 3.0, 4.0, 4.5]
    assert label_rows([0.0, 1.0, 50.0, 51.0, 52.0], span=100) == [0, 1, 0, 1, 2]
    fig = figure(build(killed_worker_run()))
    label_ax, loss_ax, _ = fig.axes[:3]
    assert not loss_ax.texts, "no label is drawn over the loss"
    assert [t.get_text().split(":")[0] for t in label_ax.texts] == ["kill-worker"]
    styles = [(line.get_linestyle(), line.get_marker()) for line in loss_ax.get_lines()]
    assert ("-", "None") in styles and ("None", ".") in styles  # a line over the points


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_a_log_line_that_is_not_an_event_does_not_fail_a_run_report_or_status(tmp_path):
    """Issue 33: a run that trained fine exited 1 at its end (``summary.json`` stale), and
    ``report``/``status`` gave a traceback, for one line of invalid UTF-8 in its log."""
    from tests.conftest import JOBS

    toy, run_dir = JOBS / "ddp_toy.yaml", tmp_path / "toy"
    first = cli("run", str(toy), "--set", "train.steps=10", run_dir=run_dir)
    assert first.code == 0, first.err
    with (run_dir / "events.jsonl").open("ab") as f:
        f.write(b'\xff\xfe{"t": 1}\n[1, 2]\n{"t": 1.0, "event": "step", "step": "ten"}\n')
    again = cli("run", str(toy), "--set", "train.steps=20", run_dir=run_dir)
    assert again.code == 0, again.err
    assert again.summary["finished"] and again.summary["steps"] == 20
    assert again.err.count("skipped 3 line(s) that are not events (first: line") == 1, again.err
    for command in (["report", str(run_dir), "--no-plot"], ["status", str(run_dir)]):
        r = cli(*command, timeout=120)
        assert r.code == 0 and "Traceback" not in r.err, (command, r.err)
        assert r.err.count("warning:") == 1 and "not UTF-8" in r.err, (command, r.err)


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_a_worker_killed_from_outside_is_a_row_of_the_report(tmp_path):
    """Issue 33: failures nobody injected were missing from ``report``. A worker SIGKILLed by
    this test (not by chaos) is detected, recovered, and its steps lost counted."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys

    from elastic_harness.events import read_events
    from tests.conftest import JOBS, REPO

    run_dir = tmp_path / "run"
    # 2,000 steps: the kill lands past step 600 (step 500's save committed), with 1,400 steps
    # left for this loop's look at the log; the 4,000 before trained 3,400 steps after the kill
    # that nothing asserts on (57 and 44 s against 36 and 30 s now, interleaved, load 2-3).
    proc = subprocess.Popen([sys.executable, "-m", "elastic_harness", "run", str(JOBS / "ddp_toy.yaml"),
                             "--set", "train.steps=2000", "--set", "checkpoint.every_steps=500",
                             "--set", "checkpoint.memory_every=0", "--run-dir", str(run_dir)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        victim = None
        while victim is None and proc.poll() is None:  # until the first generation stepped past 600
            events = read_events(run_dir / "events.jsonl")
            workers = [e for e in events if e["event"] == "worker" and e.get("rank") == 1]
            if workers and any(e["event"] == "step" and e["step"] >= 600 for e in events):
                victim = workers[0]["pid"]
            else:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=0.05)  # the job's end, or the next look at its log
        assert victim is not None, "the job ended before the test could kill a worker"
        os.kill(victim, signal.SIGKILL)
        out, err = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, err
    assert f"failure: rank 1 (pid {victim}) was killed by SIGKILL" in err
    rep = cli("report", str(run_dir), "--json", "--no-plot", timeout=120)
    assert rep.code == 0, rep.err
    data = json.loads(rep.out)
    (row,) = data["faults"]
    assert (row["kind"], row["target"], row["injected"], row["source"]) == ("SIGKILL", 1, False, "storage")
    assert row["step"] >= 600 and row["resumed_from"] % 500 == 0 and 500 <= row["resumed_from"] <= row["step"]
    assert row["steps_lost"] == row["step"] - row["resumed_from"]
    assert row["t"] <= row["detected"] < row["loaded"] < row["first_step"]
    assert data["failures"].startswith("1 failure(s): 0 injected, 1 not; 1 recovered")

