"""Long jobs (issue 22): the restart budget, start-up rendezvous errors, hangs, the recovery
tail. Fast tests of the decisions and of the real torch parts they drive; the e2e tests at
the end run the real agent (small MLP jobs)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from elastic_harness import exitcodes
from elastic_harness.agent.node import explain_rendezvous_error, hang_message, hang_reporter
from elastic_harness.events import EventLog, read_events
from elastic_harness.launch.config import NodeOptions
from elastic_harness.launch.policy import (
    budget_refill,
    exhausted_message,
    failed_stop_grace,
    restarts_after_failure,
    restarts_left,
)
from elastic_harness.records.goodput import GoodputLedger
from elastic_harness.report.timeline import is_reaction
from tests.conftest import MLP, cli
from tests.lanes import DETECTION


def opts(backend: str = "c10d", endpoint: str = "127.0.0.1:1") -> NodeOptions:
    return NodeOptions(run_dir=Path("."), rdzv_endpoint=endpoint, rdzv_id="x", rdzv_backend=backend,
                       min_nodes=1, max_nodes=1, nproc_per_node=2, max_restarts=3, is_host=False)


# ----- 1. the restart budget counts failures without progress ----------------------------------
def test_failures_far_apart_never_spend_the_budget():
    # The soak of issue 22: a crash every few hundred steps, each recovered; torch's lifetime
    # budget (window 0) ended the job at the 4th.
    steps = [150, 400, 700, 900, 1200, 1500, 1800, 2100]
    assert [restarts_left(steps[: i + 1], 3, 100) for i in range(len(steps))] == [2] * len(steps)
    assert [restarts_left(steps[: i + 1], 3, 0) for i in range(5)] == [2, 1, 0, -1, -2]


def test_failures_without_progress_spend_it():
    assert [restarts_left([50] * n, 3, 100) for n in (1, 2, 3, 4)] == [2, 1, 0, -1]
    # Close together (within the window), and a replay from storage that fails again before
    # passing the old high-water mark (the mark stays 80): all count.
    assert restarts_left([10, 40, 80, 80], 3, 100) == -1
    # Progress of a full window forgives what came before it.
    assert restarts_left([10, 40, 80, 180], 3, 100) == 2
    assert restarts_left([10, 40, 80, 179], 3, 100) == 1
    assert restarts_left([], 3, 100) == 3
    assert restarts_left([5], 0, 100) == -1  # max_restarts 0: the first failure ends it


def test_refill_keeps_torchs_restart_count():
    # torch numbers attempts max_restarts - _remaining_restarts, then takes one off as it restarts.
    for spec_max, remaining, left in [(3, 3, 2), (3, 0, 2), (7, 1, 0), (3, 2, 5)]:
        new_max, new_remaining = budget_refill(spec_max, remaining, left)
        assert new_max - new_remaining == spec_max - remaining  # same attempt number now
        assert new_remaining - 1 == left  # after torch's decrement: exactly `left` more


def _bookkeeping_agent(tmp_path, high: list[int]):
    """torch's own LocalElasticAgent (ours on it, ``max_restarts=1``, a 10-step window), never
    run: only its restart bookkeeping, driven as torch's ``_invoke_run`` drives it; progress is
    ``high[0]``. The agent, and one failed group's result."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec, WorkerState
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import ProcessFailure

    from elastic_harness.agent.elastic import AgentSettings, HarnessAgent

    class NoRendezvous:
        def get_run_id(self) -> str:
            return "t"

    spec = WorkerSpec(role="w", local_world_size=1, rdzv_handler=NoRendezvous(), entrypoint=sys.executable,
                      args=("-c", "pass"), max_restarts=1)
    agent = HarnessAgent(spec=spec, logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)),
                         settings=AgentSettings(judge=lambda: None, progress=lambda: high[0], restart_window=10))
    failed = RunResult(state=WorkerState.FAILED, failures={
        0: ProcessFailure(local_rank=0, pid=1, exitcode=-9, error_file=str(tmp_path / "none.json"))})
    return agent, failed


def test_the_agent_refills_torchs_counter_on_progress(tmp_path):
    high = [0]
    agent, failed = _bookkeeping_agent(tmp_path, high)
    spec = agent.worker_group.spec
    attempts = []
    for step in (20, 40, 60, 80):  # four failures, each after 20 steps of progress
        high[0] = step
        agent._settle_budget(failed)
        assert agent.budget.exhausted is None and agent.remaining_restarts > 0, step
        agent.remaining_restarts -= 1  # what torch does before restarting
        attempts.append(spec.max_restarts - agent.remaining_restarts)
    assert attempts == [1, 2, 3, 4]  # torch's restart count goes on counting
    agent._settle_budget(failed)  # no progress since the last one: 2 within the window > 1
    assert agent.remaining_restarts == 0
    assert "max_restarts=1" in agent.budget.exhausted and "rank 0 exit -9" in agent.budget.exhausted


def test_a_peers_failure_heard_first_is_judged_by_the_refilled_budget(tmp_path):
    """In place, a survivor's failed collective may be heard before any exit of this node:
    the agent then decides, before the failure is settled, whether the group is kept (a restart
    follows) or killed. torch's counter still reads what the last restart left (0 with
    max_restarts=1); the window forgave that restart since (CI: the survivors were killed, and
    the kill counted as a second failure without progress, ending the job)."""
    assert restarts_after_failure([13], 30, 1, 10) == 1  # 17 steps since: forgiven, one restart follows
    assert restarts_after_failure([13], 20, 1, 10) == 0  # within the window: the budget is spent
    assert restarts_after_failure([], 5, 3, 0) == 3

    high = [13]
    agent, failed = _bookkeeping_agent(tmp_path, high)
    agent._settle_budget(failed)
    agent.remaining_restarts -= 1  # torch restarts
    high[0] = 30
    assert agent.remaining_restarts == 0 and agent.budget.after_failure(high[0]) == 1
    high[0] = 20
    assert agent.budget.after_failure(high[0]) == 0


# ----- 6. the restarts-exhausted message -------------------------------------------------------
def test_the_exhausted_message_names_the_limit_and_the_fix():
    line = exhausted_message(4, 3, 100, "rank 1 exit -9")
    assert "max_restarts=3" in line and "restart_window=100" in line and "4 times" in line
    assert "--set max_restarts=N" in line and "--max-restarts" in line and "rank 1 exit -9" in line
    assert "lifetime" in exhausted_message(4, 3, 0, "x") and "\n" not in line


# ----- 2. an unreachable rendezvous backend at start-up ----------------------------------------
def test_an_unreachable_backend_at_start_is_explained():
    line = explain_rendezvous_error("RendezvousConnectionError", "refused", opts("etcd-v2"), 60, at_start=True)
    assert "127.0.0.1:1" in line and "--enable-v2" in line and "rendezvous.endpoint" in line
    line = explain_rendezvous_error("RendezvousConnectionError", "refused", opts("etcd-v3"), 60, at_start=True)
    assert "127.0.0.1:1" in line and "3.4 or newer" in line and "--enable-v2" not in line
    line = explain_rendezvous_error("EtcdMisconfigured", "the etcd at x refused user 'u' ...: fix either",
                                    opts("etcd-v3"), 60, at_start=True)
    assert line.startswith("the etcd at x refused user") and "nothing was trained" in line
    line = explain_rendezvous_error("RendezvousConnectionError", "refused", opts("c10d"), 60, at_start=True)
    assert "127.0.0.1:1" in line and "--is-host" in line
    line = explain_rendezvous_error("RendezvousConnectionError", "Bad response : 404 page not found\n",
                                    opts("etcd-v2"), 60, at_start=True)
    assert "no v2 API" in line and "--enable-v2" in line and "\n" not in line
    # ... which is the job's configuration, not an outage: exit 2, no "re-run once it is up"
    from elastic_harness.agent.node import etcd_without_v2, rendezvous_exit_code

    assert etcd_without_v2(opts("etcd-v2"), "Bad response : 404 page not found") and \
        not etcd_without_v2(opts("etcd-v3"), "404") and not etcd_without_v2(opts("etcd-v2"), "refused")
    assert rendezvous_exit_code("EtcdWithoutV2") == exitcodes.PERMANENT
    line = explain_rendezvous_error("EtcdWithoutV2", "Bad response : 404 page not found", opts("etcd-v2"), 60,
                                    at_start=True)
    assert "use rendezvous.backend: etcd" in line and "once it is up" not in line
    # Later, losing the c10d host is another story.
    assert "host lost" in explain_rendezvous_error("RendezvousConnectionError", "", opts("c10d"), 60)


# ----- 5. a hung worker leaves a cause ---------------------------------------------------------
def test_the_watchdog_reports_the_worker_it_killed(tmp_path):
    """torch's FileTimerServer (ours, minus suicide) kills a worker that stopped re-arming its
    timer, and says which and after how long."""
    from elastic_harness.agent import watchdog

    server = watchdog.start("t", tmp_path)
    heard: list[tuple[int, float]] = []
    done = threading.Event()
    server.on_reap = lambda pid, silent, state: (heard.append((pid, silent, state)), done.set())
    code = ("import os, time; from torch.distributed.elastic.timer import FileTimerClient; "
            f"FileTimerClient({str(os.environ[watchdog.TIMER_FILE_VAR])!r}).acquire('s', time.time() + 1.0); "
            "os.kill(os.getpid(), 19)")  # SIGSTOP: frozen, as in the issue
    worker = subprocess.Popen([sys.executable, "-c", code])
    try:
        assert done.wait(60), "the watchdog did not kill the frozen worker"
        assert worker.wait(30) == -signal.SIGKILL
    finally:
        server.stop()
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    (pid, silent, state), = heard
    assert pid == worker.pid and silent > 0.5  # since the server read the arming (1 s budget)
    assert state == "T"  # it was SIGSTOPped, not waiting on someone


def test_a_hang_is_recorded_as_a_failure_and_booked_as_hang_detection(tmp_path):
    log = EventLog(tmp_path / "events.jsonl")
    hang_reporter(log, "n0", rank_of={4242: 1}.get, last_step=lambda: 17, timeout_s=60)(4242, 61.4, "T")
    (e,) = read_events(tmp_path / "events.jsonl")
    assert (e["event"], e["cause"], e["rank"], e["step"], e["node"], e["seconds"]) == ("failure", "hang", 1, 17, "n0", 61.4)
    assert e["message"] == hang_message("rank 1", 17, 61.4, 60, "T") and "timeouts.step=60s" in e["message"]
    assert "stopped by a signal" in e["message"] and "stopped" not in hang_message("rank 0", 17, 61.4, 60, "S")
    assert is_reaction(e)
    # A generation stepping to t=10, the watchdog's kill at 70, rendezvous at 71, resume at 72.
    ledger = GoodputLedger()
    for ev in [{"event": "start", "who": "host", "t": 0.0}, {"event": "resume", "pid": 1, "t": 1.0, "step": 0},
               {"event": "step", "pid": 1, "t": 10.0, "step": 17}, {**e, "t": 70.0},
               {"event": "rendezvous", "pid": 2, "t": 71.0}, {"event": "resume", "pid": 2, "t": 72.0, "step": 17},
               {"event": "step", "pid": 2, "t": 73.0, "step": 18}]:
        ledger.update(ev)
    g = ledger.goodput()
    assert g.badput["hang_detection"] == pytest.approx(60.0)
    assert g.badput["rendezvous"] == pytest.approx(1.0) and g.badput["restart"] == pytest.approx(1.0)
    assert g.productive_s + sum(g.badput.values()) == pytest.approx(g.wall_s)


# ----- 7. the 30 s recovery tail ---------------------------------------------------------------
@pytest.mark.timeout(25)
def test_a_failed_groups_survivor_is_stopped_within_the_bound(tmp_path):
    """torch's process context stops a failed group's survivors with ``close()``: a fixed 30 s
    grace for one that ignores SIGTERM (the pytest timeout, 25 s, catches that)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    from elastic_harness.agent.elastic import bound_failure_close

    stubborn = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "open(__import__('sys').argv[1], 'w').close(); time.sleep(120)")
    ready = tmp_path / "ready"
    fails = ("import os, sys, time\nwhile not os.path.exists(sys.argv[1]): time.sleep(0.01)\nsys.exit(3)")
    # torch's process context installs its own SIGTERM/SIGINT/SIGHUP/SIGQUIT handlers in the
    # caller (here: pytest) and never puts the old ones back: this test does.
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
    try:
        ctx = start_processes(name="t", entrypoint=sys.executable,
                              args={0: ("-c", stubborn, str(ready)), 1: ("-c", fails, str(ready))},
                              envs={0: {}, 1: {}}, logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs")))
        bound_failure_close(ctx, failed_stop_grace(30))
        result = ctx.wait()  # polls until a failure, then stops the rest
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert result.failures[1].exitcode == 3
    assert result.failures[0].exitcode == -signal.SIGKILL  # SIGTERM ignored: killed after the bound
    assert failed_stop_grace(30) <= 5 and failed_stop_grace(1) == 1


# ----- e2e ---------------------------------------------------------------------------------
@DETECTION
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_job_with_crashes_far_apart_outlives_max_restarts(tmp_path):
    """Three worker crashes, each after more than restart_window steps of progress, with
    max_restarts=1: torch's lifetime budget ended this job at the second crash."""
    r = cli("run", str(MLP), "--set", "max_restarts=1", "--set", "restart_window=10", "--set", "train.steps=60",
            "--chaos", "kill-worker:1@15", "--chaos", "kill-worker:0@30", "--chaos", "kill-worker:1@45",
            run_dir=tmp_path)
    assert r.code == 0, r.err
    assert len(r.kinds("fault")) == 3 and r.summary["finished"] and r.summary["restarts"] >= 3


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_an_unreachable_etcd_at_start_is_one_line_and_exit_200(tmp_path):
    r = cli("run", str(MLP), "--set", "rendezvous.backend=etcd", "--set", "rendezvous.endpoint=127.0.0.1:1",
            run_dir=tmp_path)
    assert r.code == exitcodes.INFRA, (r.code, r.err)
    assert "127.0.0.1:1" in r.err and "3.4 or newer" in r.err and "Traceback" not in r.err
    assert not r.kinds("step")


# ----- 3. a pinned rendezvous id does not defeat the run-dir lock ------------------------------
def _holder(rdzv: str, submission: str, pid: int = 4242):
    from elastic_harness.checkpoint import lock

    h = lock.Holder.this_process("mlp", rdzv, submission=submission)
    return lock.Holder(**{**h.__dict__, "pid": pid, "token": f"tok-{pid}"})


def test_a_second_submission_with_the_same_pinned_id_is_refused():
    from elastic_harness.checkpoint.lock import decide

    first = _holder("pinned", "sub-a", pid=1).record(100.0)
    alive = lambda record: True  # noqa: E731
    assert decide(first, _holder("pinned", "sub-b"), 101.0, alive).action == "refuse"
    assert decide(first, _holder("pinned", "sub-a"), 101.0, alive).action == "join"  # its own agents
    assert decide(first, _holder("pinned", ""), 101.0, alive).action == "join"  # a scheduler's agent, a worker
    assert decide({**first, "submission": ""}, _holder("pinned", "sub-b"), 101.0, alive).action == "join"
    gone = decide(first, _holder("pinned", "sub-b"), 101.0, lambda record: False)
    assert gone.action == "takeover" and "no longer running" in gone.reason


def test_a_fenced_generation_that_finishes_does_not_report_success():
    from elastic_harness.commands.run import Happened, outcome
    from elastic_harness.records.runstate import RunState

    state = RunState()
    for e in [{"event": "step", "pid": 7, "step": 59, "t": 1.0},
              {"event": "fenced", "pid": 7, "step": 60, "t": 2.0},
              {"event": "finish", "pid": 7, "step": 60, "t": 3.0}]:
        state.update(e)
    assert not state.finished and "superseded" in state.superseded and "1 of its saves" in state.superseded
    code, message = outcome(Happened(finished=state.finished, fatal=None, permanent="", stopped_by=None, codes={0: 0},
                                     superseded=state.superseded))
    assert code == exitcodes.FAILED and message == state.superseded
    # A newer generation (another pid) that finishes is the job's success.
    state.update({"event": "finish", "pid": 8, "step": 60, "t": 4.0})
    assert state.finished


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_the_same_command_twice_with_a_pinned_id_trains_once(tmp_path):
    from tests.conftest import read_jsonl, training_in_background

    run_dir = tmp_path / "run"
    with training_in_background(run_dir, "--job-id", "pinned"):
        second = cli("run", str(MLP), "--job-id", "pinned", run_dir=run_dir, timeout=120)
        assert second.code == 2 and "Traceback" not in second.err, second.err
        assert "is in use by job 'mlp' (rendezvous id pinned" in second.err
        starts = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "start" and e.get("who") == "host"]
        assert len(starts) == 1, "the second submission must not have started"


# ----- 4. every rank is waited for after the last step, within a bound ------------------------
def test_what_is_still_running_after_the_bound_is_reported():
    from elastic_harness.commands.run import Happened, cut_short, group_members, outcome
    from elastic_harness.launch.policy import finish_bound_s

    where = {0: "1", 1: "0", 2: "0", 3: "2", -1: "3"}  # rank 3 (node 2) belonged to an older, larger group
    assert group_members(where) == {"1": {0}, "0": {1, 2}}
    line = cut_short([0], group_members(where), finish_bound_s(120, 30))
    assert "node 0 (ranks 1, 2)" in line and "150s" in line and "cut short" in line
    assert cut_short([], {}, 150) == ""
    code, message = outcome(Happened(finished=True, fatal=None, permanent="", stopped_by=None, codes={0: 143},
                                     cut_short=line))
    assert (code, message) == (exitcodes.FAILED, line)


@DETECTION
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_rank_working_after_close_is_waited_for_then_reported(tmp_path):
    """Rank 1 works 16 s after run.close(), then hangs. The bound here is 30 + 3 = 33 s (room for
    a loaded machine between the finish event and close()); the
    host used to stop every node shutdown_grace + 10 = 13 s after the last step and report
    success."""
    from tests.conftest import REPO

    marker = tmp_path / "exported"
    job = tmp_path / "job.yaml"
    job.write_text(f"name: lingers\nscript: {{path: {REPO / 'tests/scripts/lingers.py'}, "
                   f"args: [--linger, '16', --marker, '{marker}']}}\nnproc_per_node: 2\n"
                   "train: {steps: 4, global_batch_size: 4, micro_batch_size: 2}\n"
                   "timeouts: {process_group: 30, shutdown_grace: 3}\n")
    r = cli("run", str(job), run_dir=tmp_path / "run", timeout=240)
    assert marker.exists(), "rank 1's work after close was cut short before the bound"
    assert r.code == exitcodes.FAILED, (r.code, r.err)
    assert "node 0 (ranks 0, 1) still ran 33s later" in r.err and "cut short" in r.err


# ----- 7. bench recovery keeps every recovery's breakdown ---------------------------------------
def test_bench_keeps_each_recoverys_phases():
    from elastic_harness.bench.recovery import crash_stats
    from tests.report.test_report import ev, killed_worker_run

    events = [e for e in killed_worker_run() if e["event"] != "rendezvous" or e["pid"] != 20]
    events += [ev(12.6, "workers", 5, state="failed"), ev(12.65, "workers", 5, state="stopped"),
               ev(16.5, "rendezvous", 20, world_size=2, restart=1, pg_init_s=0.1)]
    events.sort(key=lambda e: e["t"])
    summary = crash_stats.crash_summary(events, requested=1, code=0)
    (one,) = summary["recoveries"]
    assert one["step"] == 25 and one["target"] == 1
    assert one["recovery_s"] == pytest.approx(17.1 - 12.55)
    assert one["phases_s"] == pytest.approx({"detect": 0.05, "stop": 0.05, "rendezvous": 0.35, "spawn": 3.4,
                                             "process_group": 0.1, "restore": 0.5, "first_step": 0.1})


@DETECTION
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_frozen_rank_is_recorded_as_a_hang_and_booked_as_hang_detection(tmp_path):
    """SIGSTOP rank 1 at step 20; the step watchdog (4 s here) kills it and the group
    restarts. It used to leave no failure at all, and report booked the time as rendezvous."""
    r = cli("run", str(MLP), "--set", "timeouts.step=4", "--chaos", "hang:1@20", run_dir=tmp_path)
    assert r.code == 0, r.err
    hangs = [e for e in r.kinds("failure") if e.get("cause") == "hang"]
    assert 1 in {e["rank"] for e in hangs}, hangs
    hang = next(e for e in hangs if e["rank"] == 1)
    assert hang["step"] >= 20 and hang["seconds"] > 0 and hang["state"] == "T"
    assert "rank 1 hung (it was stopped by a signal)" in hang["message"]
    assert any("rank 1 hung" in m for m in r.summary["failures"])
    assert r.summary["goodput"]["badput"]["hang_detection"] > 0


@DETECTION
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_frozen_rank_with_the_watchdog_off_is_still_named_as_hung(tmp_path):
    """timeouts.step=0 (no step watchdog): rank 1 frozen at step 5 was reported 120 s later
    by gloo's source path ("RuntimeError: [.../gloo/transport/tcp/unbound_buffer.cc:78] Timed
    out waiting ..."), the survivor's words. The agent finds rank 1 stopped when its group
    fails, and names it: "rank 1 (pid N) hung (it was stopped by a signal)". In place, rank 0
    leaves its step and keeps its process; rank 1 is not waited for (it cannot park)."""
    r = cli("run", str(MLP), "--set", "timeouts.step=0", "--set", "timeouts.process_group=8",
            "--set", "train.steps=12", "--chaos", "hang:1@5", run_dir=tmp_path)
    assert r.code == 0, r.err
    said = [line for line in r.err.splitlines() if line.startswith("failure:")]
    assert len(said) == 1 and said[0].startswith("failure: rank 1 (pid "), said
    assert "hung (it was stopped by a signal): its peers waited on it" in said[0]
    assert "gloo" not in r.err and "did not leave its step in time" not in r.err
    (rec,) = r.kinds("recovery")
    first = {e["rank"]: e["pid"] for e in r.kinds("worker") if e["restart"] == 0}
    assert rec["kept"] == [first[0]] and first[1] not in rec["new"]
    (account,) = [e for e in r.kinds("failure") if e.get("cause") == "exit"]
    assert (account["rank"], account["recorded"]) == (1, False)
