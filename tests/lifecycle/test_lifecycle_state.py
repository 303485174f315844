"""Job lifecycle, the pure parts: exit codes a scheduler acts on, the state decision, the
status of a submission from its events, the registry and ``--since``.

Everything here runs in this process on data written by the test; the end-to-end tests
(``test_e2e_lifecycle.py``, ``test_e2e_slurm.py``) drive the same code through real jobs.
"""

from __future__ import annotations

import signal
import time

import pytest

from elastic_harness import exitcodes
from elastic_harness.agent.node import rendezvous_exit_code
from elastic_harness.commands.jobs import parse_since
from elastic_harness.commands.run import Happened, outcome
from elastic_harness.errors import HarnessError
from elastic_harness.lifecycle import display, registry
from elastic_harness.lifecycle.registry import JobRecord
from elastic_harness.lifecycle.state import (
    JobStatus,
    Liveness,
    decide,
    invocation_of,
    status_from_events,
)

pytestmark = pytest.mark.timeout(60)


def test_exit_codes_say_whether_a_retry_can_help():
    table = {0: "ok", 1: "failed", 2: "permanent", 143: "preempted", 130: "preempted", 129: "preempted",
             192: "preempted", 193: "failed", exitcodes.INFRA: "infrastructure", None: ""}
    assert {code: exitcodes.kind(code) for code in table} == table
    assert [c for c in table if exitcodes.retry(c)] == [143, 130, 129, 192, exitcodes.INFRA]
    assert exitcodes.INFRA >= 128, "Kubeflow's ExitCode policy retries only 128..255"
    assert exitcodes.SIGNAL_CODES[1] < exitcodes.INFRA, "never mistaken for a signal"
    assert rendezvous_exit_code("RendezvousTimeoutError") == exitcodes.INFRA  # too few nodes
    assert rendezvous_exit_code("RendezvousConnectionError") == exitcodes.INFRA  # host lost
    assert rendezvous_exit_code("RendezvousClosedError") == exitcodes.PERMANENT  # a new id fixes it
    assert rendezvous_exit_code("EtcdMisconfigured") == exitcodes.PERMANENT  # etcd refused the job's settings


def test_the_hosts_exit_code_follows_what_the_agents_said():
    base = dict(finished=False, fatal=None, permanent="", stopped_by=None)
    assert outcome(Happened(**{**base, "finished": True}, codes={0: 0})) == (0, "")
    assert outcome(Happened(**{**base, "fatal": "bad checkpoint"}, codes={0: 2}))[0] == exitcodes.PERMANENT
    assert outcome(Happened(**{**base, "permanent": "crash loop"}, codes={0: 2})) == (2, "crash loop")
    code, message = outcome(Happened(**{**base, "stopped_by": signal.SIGINT, "drained_at": 7}, codes={0: 143}))
    assert (code, message) == (130, "job stopped by SIGINT; drained and saved at step 7")
    code, message = outcome(Happened(**base, codes={0: 143}, drained_at=7, agent_exits=[(143, "agent received SIGTERM")]))
    assert message == "job stopped by agent received SIGTERM; drained and saved at step 7"
    assert outcome(Happened(**base, codes={0: 1}, agent_exits=[(0, ""), (1, "boom")]))[1] == "job failed: boom"
    assert outcome(Happened(**base, codes={0: 143, 1: exitcodes.INFRA}))[0] == exitcodes.PREEMPTED
    assert outcome(Happened(**base, codes={0: exitcodes.INFRA, 1: -9}))[0] == exitcodes.INFRA
    assert outcome(Happened(**base, codes={0: 1}))[0] == exitcodes.FAILED


def test_a_plain_script_that_exited_0_everywhere_has_finished():
    """Issue 33: a torchrun-style script (no harness session, so no ``finish`` event) that
    exited 0 on every rank was reported as "job failed: agents exited with {0: 0}", exit 1."""
    base = dict(finished=False, fatal=None, permanent="", stopped_by=None)
    code, message = outcome(Happened(**base, codes={0: 0, 1: 0}, sessions=0))
    assert code == exitcodes.OK and "exited 0 on every rank" in message
    assert outcome(Happened(**base, codes={0: 0, 1: 1}, sessions=0))[0] == exitcodes.FAILED
    assert outcome(Happened(**base, codes={0: 0}, sessions=1))[0] == exitcodes.FAILED, "a session that did not finish"
    assert outcome(Happened(**{**base, "stopped_by": signal.SIGTERM}, codes={0: 0}, sessions=0))[0] == 128 + signal.SIGTERM


GONE, RUNNING, QUEUED = Liveness("gone", detail="pid 5 is gone"), Liveness("running"), Liveness("queued")


@pytest.mark.parametrize("facts, want", [
    (dict(finished=True, live=GONE), ("succeeded", "")),
    (dict(finished=True, exit=(0, ""), live=GONE), ("succeeded", "")),
    # the last step finished, but the host's verdict is a failure: `run --verify` found another model
    (dict(finished=True, exit=(1, "--verify: the final model is not r's"), live=GONE),
     ("failed", "--verify: the final model is not r's (exit 1: see `elastic-harness logs`; submitting again resumes)")),
    (dict(exit=(0, ""), live=GONE), ("succeeded", "")),
    (dict(exit=(143, "m"), stop={"now": False}, live=GONE, drained=9), ("stopped", "on request; drained and saved at step 9")),
    (dict(exit=(130, "m"), live=GONE, drained=4), ("stopped", "interrupted (SIGINT); drained and saved at step 4")),
    (dict(exit=(143, "m"), live=GONE, drained=3), ("preempted", "drained and saved at step 3; submit again to resume")),
    (dict(exit=(2, "crash loop"), live=GONE), ("failed", "crash loop (exit 2: a mistake to fix first; then submit again to resume)")),
    (dict(exit=(exitcodes.INFRA, "too few nodes"), live=GONE), ("failed", "too few nodes (exit 200: the infrastructure failed; submit again to resume)")),
    (dict(live=Liveness("gone", exit_code=143, detail="Slurm job 7: FAILED"), stop={"now": False}),
     ("stopped", "on request; Slurm job 7: FAILED")),
    (dict(live=QUEUED), ("pending", "queued")),
    (dict(live=RUNNING), ("pending", "waiting for nodes to join")),
    (dict(live=RUNNING, started=True), ("running", "")),
    (dict(live=RUNNING, started=True, stop={"now": False}), ("running", "stop requested")),
    (dict(live=GONE, started=True), ("failed", "pid 5 is gone, without recording an exit")),
    (dict(live=GONE, started=True, stop={"now": True}), ("stopped", "killed on request (stop --now)")),
    (dict(live=Liveness("unknown", detail="on host b: cannot be checked"), started=True),
     ("running", "on host b: cannot be checked")),
])
def test_state_decision(facts, want):
    args = dict(finished=False, exit=None, stop=None, started=False)
    assert decide(**{**args, **facts}) == want


def ev(t, event, **fields):
    return {"t": t, "event": event, "pid": 1, **fields}


def two_submissions():
    """The first submission drained at step 6 and exited 143; the second is training."""
    return [ev(0, "start", who="host", run_id="a"), ev(1, "rendezvous", world_size=2, nodes=1),
            ev(2, "resume", fresh=True, step=0), ev(3, "step", step=6, loss=0.5, world_size=2),
            ev(4, "checkpoint", step=6, path="/r/step-6"), ev(4.5, "drain", step=6),
            ev(5, "exit", who="host", code=143, message="stopped"),
            ev(10, "start", who="host", run_id="b"), ev(11, "rendezvous", world_size=2, nodes=1),
            ev(12, "resume", step=6), ev(13, "step", step=9, loss=0.25, world_size=2)]


def test_a_submission_is_read_from_its_own_events_only():
    events = two_submissions()
    assert [e["t"] for e in invocation_of(events, "a")] == [0, 1, 2, 3, 4, 4.5, 5]
    assert invocation_of(events, "nope") == []
    base = JobStatus(id="a", name="mlp", scheduler="local", state="", total_steps=60)
    first = status_from_events(base, events, GONE, {"now": False}, now=100.0)
    assert (first.state, first.reason, first.step, first.exit_code) == ("stopped", "on request; drained and saved at step 6", 6, 143)
    assert (first.last_checkpoint_step, first.wall_s, first.recoveries) == (6, 5.0, 0)
    second = status_from_events(JobStatus(id="b", name="mlp", scheduler="local", state=""), events, RUNNING,
                                None, now=20.0)
    assert (second.state, second.step, second.loss, second.world_size, second.nodes) == ("running", 9, 0.25, 2, 1)
    assert (second.recoveries, second.restarts, second.wall_s) == (1, 0, 10.0), "wall time of a live job runs on"
    text = display.detail(second)
    assert "9/0" not in text and "running" in text and "2 ranks on 1 nodes" in text
    table = display.table([first, second]).splitlines()
    assert table[0].split()[:3] == ["ID", "STATE", "STEP"] and table[1].split()[:3] == ["a", "stopped", "6/60"]


def record(job_id: str, submitted: float, name: str = "mlp", run_dir: str = "") -> JobRecord:
    return JobRecord(id=job_id, name=name, scheduler="local", submitted=submitted, total_steps=10, run_dir=run_dir)


def test_registry_finds_jobs_by_id_prefix_and_name(tmp_path, monkeypatch):
    monkeypatch.setenv(registry.STATE_VAR, str(tmp_path / "state"))
    root = registry.state_dir()
    assert root == tmp_path / "state"
    assert registry.state_dir({"XDG_STATE_HOME": "/x"}) == registry.Path("/x/elastic-harness")
    for r in (record("mlp-aaa111", 1.0), record("mlp-aab222", 2.0), record("cnn-ccc333", 3.0, name="cnn")):
        registry.save(r, root)
    (root / "jobs" / "broken.json").write_text("{not json")
    assert [r.id for r in registry.records(root)] == ["mlp-aaa111", "mlp-aab222", "cnn-ccc333"]
    assert registry.find("mlp-aab222", root).submitted == 2.0
    assert registry.find("cnn", root).id == "cnn-ccc333"
    assert registry.find("mlp", root).id == "mlp-aab222", "a name: its newest submission"
    with pytest.raises(HarnessError, match="matches 2 jobs"):
        registry.find("mlp-aa", root)
    with pytest.raises(HarnessError, match="no job 'zzz'") as e:
        registry.find("zzz", root)
    assert "elastic-harness list" in e.value.hint


def test_stop_requests_sit_beside_what_they_stop(tmp_path):
    root = tmp_path / "state"
    local = record("mlp-1", 1.0, run_dir=str(tmp_path / "run"))
    kube = record("mlp-2", 1.0)
    assert registry.stop_request(local, root) is None
    registry.request_stop(local, root, now=False, clock=lambda: 42.0)
    registry.request_stop(kube, root, now=True)
    assert registry.stop_path(local, root) == tmp_path / "run" / "lifecycle" / "mlp-1.stop"
    assert registry.stop_request(local, root)["t"] == 42.0 and registry.stop_request(local, root)["now"] is False
    assert registry.stop_path(kube, root) == root / "jobs" / "mlp-2.stop" and registry.stop_request(kube, root)["now"]


def test_since_takes_durations_and_times():
    now = time.mktime(time.strptime("2026-03-04 12:00:00", "%Y-%m-%d %H:%M:%S"))
    assert parse_since("90s", now) == now - 90 and parse_since("10m", now) == now - 600
    assert parse_since("2h", now) == now - 7200
    assert parse_since("11:30", now) == now - 1800
    assert parse_since("2026-03-04 11:59:30", now) == now - 30
    for bad in ("yesterday", "10x", "25:99"):
        with pytest.raises(HarnessError, match="neither a duration nor a time"):
            parse_since(bad, now)


def test_a_record_keeps_how_its_job_ended_once_the_run_dir_is_gone(cli_here, tmp_path, monkeypatch):
    """A finished job whose run dir was removed said "failed: supervisor ... gone, without
    recording an exit". Its outcome is kept in its record when it is seen ended; `list --prune`
    forgets ended jobs (records only) and keeps the active ones."""
    import json
    import os
    import shutil
    import socket

    from elastic_harness.checkpoint.lock import process_start

    monkeypatch.setenv(registry.STATE_VAR, str(tmp_path / "state"))
    root = registry.state_dir()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with open(run_dir / "events.jsonl", "w") as f:
        for e in [ev(0, "start", who="host", run_id="done-1"), ev(1, "rendezvous", world_size=2, nodes=1),
                  ev(2, "step", step=10, loss=0.5, world_size=2), ev(3, "finish", step=10, loss=0.5, digest="ab"),
                  ev(4, "exit", who="host", code=0, message="")]:
            f.write(json.dumps(e) + "\n")
    gone = {"host": socket.gethostname(), "pid": 2**22 + 1, "pid_start": "1"}  # above pid_max: no such process
    registry.save(JobRecord(id="done-1", name="mlp", scheduler="local", submitted=1.0, total_steps=10,
                            run_dir=str(run_dir), details=gone), root)
    alive = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": process_start(os.getpid())}
    registry.save(JobRecord(id="live-2", name="mlp", scheduler="local", submitted=2.0, total_steps=10,
                            run_dir=str(tmp_path / "other"), details=alive), root)
    first = json.loads(cli_here("status", "done-1", "--json").out)
    assert (first["state"], first["step"]) == ("succeeded", 10)
    shutil.rmtree(run_dir)
    later = json.loads(cli_here("status", "done-1", "--json").out)
    assert (later["state"], later["step"], later["model_digest"]) == ("succeeded", 10, "ab")
    assert later["reason"] == f"as recorded when it ended; {run_dir} no longer holds its events"
    pruned = cli_here("list", "--prune")
    assert pruned.code == 0 and "forgot 1 job(s) that ended (done-1); 1 kept" in pruned.out
    assert [r.id for r in registry.records(root)] == ["live-2"]
    assert cli_here("list", "--older-than", "2h").code == 2, "--older-than without --prune is refused"


def test_what_status_shows_once_the_evidence_is_gone():
    from elastic_harness.lifecycle.state import settled, worth_recording

    ended = JobStatus(id="a", name="mlp", scheduler="local", state="succeeded", run_dir="/r", step=10)
    blank = JobStatus(id="a", name="mlp", scheduler="local", state="failed", run_dir="/r",
                      reason="supervisor pid 5 is gone, without recording an exit")
    assert worth_recording(ended, {}) and not worth_recording(ended, ended.to_dict())
    assert not worth_recording(blank, {}), "no evidence: nothing worth keeping"
    assert not worth_recording(JobStatus(id="a", name="m", scheduler="local", state="running", step=3), {})
    assert settled(blank, {}) == blank, "nothing recorded: what the scheduler says"
    assert settled(blank, ended.to_dict()).state == "succeeded"
    assert settled(ended, {**ended.to_dict(), "state": "failed"}) == ended, "evidence outranks the record"


def test_an_agents_error_names_its_fix_or_says_nothing(tmp_path):
    """Every agent-side etcd error ended with a vacuous "fix: fix it (full traceback in ...)"."""
    from elastic_harness.commands.run import _error

    etcd = _error(exitcodes.PERMANENT, "job failed: the etcd at x refused user 'job' ...: fix either", tmp_path,
                  from_agent=True)
    assert etcd.hint == "" and "fix: " not in str(etcd)
    loop = _error(exitcodes.PERMANENT, "crash loop: the workers failed the same way twice at step 3: "
                  "ValueError: bad (at train.py:12)", tmp_path, from_agent=True)
    assert loop.hint.startswith("fix the error in the code it names") and str(tmp_path / "logs") in loop.hint
    own = _error(exitcodes.PERMANENT, "bad thing\n  fix: do this", tmp_path, from_agent=True)
    assert own.hint == "" and str(own).count("fix:") == 1
