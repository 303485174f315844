"""The lifecycle's bad input, each case named in issue 10: one ``error:`` line with its fix,
exit 2, nothing started, nothing lost. In this process (``cli_here``), through ``cli.main``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from elastic_harness.checkpoint.lock import Holder, Lease, process_start
from elastic_harness.checkpoint.storage import LocalStorage
from elastic_harness.lifecycle import registry
from elastic_harness.lifecycle.registry import JobRecord
from tests.cli.test_bad_args import assert_one_line_error
from tests.conftest import MLP

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def state(tmp_path, monkeypatch):
    monkeypatch.setenv(registry.STATE_VAR, str(tmp_path / "state"))
    return tmp_path / "state"


def finished_job(state, run_dir) -> JobRecord:
    """A registered job whose run dir says it finished (events as `run` writes them)."""
    run_dir.mkdir(parents=True)
    events = [{"t": 1.0, "event": "start", "pid": 1, "who": "host", "run_id": "mlp-done"},
              {"t": 2.0, "event": "finish", "pid": 1, "step": 60, "loss": 0.1, "digest": "d"},
              {"t": 3.0, "event": "exit", "pid": 1, "who": "host", "code": 0, "message": ""}]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    rec = JobRecord(id="mlp-done", name="mlp", scheduler="local", submitted=1.0, total_steps=60,
                    run_dir=str(run_dir), details={"pid": 1, "host": "elsewhere"})
    registry.save(rec, state)
    return rec


def test_unknown_job_and_stopping_a_finished_one(cli_here, state, tmp_path):
    r = cli_here("status", "mlp-0000")
    assert_one_line_error(r, "no job 'mlp-0000'", "fix: elastic-harness list shows the known jobs")
    finished_job(state, tmp_path / "run")
    assert cli_here("status", "mlp-done").code == 0
    r = cli_here("stop", "mlp-done")
    assert r.code == 0 and "job mlp-done is not running: it succeeded; nothing to stop" in r.out, "idempotent"
    assert registry.stop_request(registry.find("mlp-done", state), state) is None, "nothing was asked of it"


def test_logs_of_a_rank_or_node_the_job_never_had(cli_here, state, tmp_path):
    rec = finished_job(state, tmp_path / "run")
    with open(tmp_path / "run" / "events.jsonl", "a") as f:
        for rank in (0, 1):
            f.write(json.dumps({"t": 1.5, "event": "worker", "pid": 9, "rank": rank, "local_rank": rank,
                                "node": "0", "restart": 0}) + "\n")
    assert_one_line_error(cli_here("logs", rec.id, "--rank", "7"), "job mlp-done has no rank 7: its ranks were 0..1",
                          "--rank 0..1")
    assert_one_line_error(cli_here("logs", rec.id, "--node", "3"), "has no node '3': its nodes were 0")
    known = cli_here("logs", rec.id, "--rank", "1")  # a rank it had: not refused, but it wrote no log
    assert known.code == 1 and "has no rank" not in known.err and "has no logs for --rank 1" in known.err


def test_fresh_keeps_an_earlier_submissions_record(cli_here, state, tmp_path):
    """`run --fresh` moves the run dir's events aside (rundir.set_aside_old): the earlier,
    successful submission is still found there, not turned into 'supervisor gone'."""
    from elastic_harness.records.rundir import set_aside_old

    run_dir = tmp_path / "run"
    finished_job(state, run_dir)
    with open(run_dir / "events.jsonl", "a") as f:
        for rank in (0, 1):
            f.write(json.dumps({"t": 1.5, "event": "worker", "pid": 9, "rank": rank, "node": "0"}) + "\n")
    set_aside_old(run_dir, str(run_dir / "checkpoints"), "20260101-000000")
    (run_dir / "events.jsonl").write_text(json.dumps({"t": 5.0, "event": "start", "pid": 2, "who": "host",
                                                      "run_id": "mlp-next"}) + "\n")
    r = cli_here("status", "mlp-done", "--json")
    st = json.loads(r.out)
    assert (st["state"], st["step"], st["model_digest"]) == ("succeeded", 60, "d")
    assert_one_line_error(cli_here("logs", "mlp-done", "--rank", "7"), "its ranks were 0..1")


def test_a_scheduler_whose_commands_are_missing(cli_here, state, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    r = cli_here("submit", MLP, "--scheduler", "slurm", "--run-dir", tmp_path / "run")
    assert_one_line_error(r, "sbatch not found on PATH", "fix: install Slurm's client commands")
    r = cli_here("submit", MLP, "--scheduler", "k8s")
    assert_one_line_error(r, "kubectl not found on PATH")
    assert not (tmp_path / "run").exists() and not (state / "jobs").exists()


def test_kubectl_without_a_context(cli_here, state, tmp_path, monkeypatch):
    """The real kubectl, with a kubeconfig that names no context."""
    empty = tmp_path / "kubeconfig"
    empty.write_text("apiVersion: v1\nkind: Config\nclusters: []\ncontexts: []\nusers: []\n")
    monkeypatch.setenv("KUBECONFIG", str(empty))
    r = cli_here("submit", MLP, "--scheduler", "k8s")
    assert_one_line_error(r, "kubectl has no current context", "kubectl config use-context")


def test_a_run_dir_owned_by_a_live_job_is_refused_by_name(cli_here, state, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lease = Lease.acquire(LocalStorage(run_dir), Holder.this_process("mlp", "mlp-holder1234"))
    try:
        r = cli_here("submit", MLP, "--run-dir", run_dir)
        assert_one_line_error(r, f"run directory '{run_dir}' is in use by job 'mlp' (rendezvous id mlp-holder1234",
                              "stop it first (elastic-harness stop mlp-holder1234)")
    finally:
        lease.release()
    # Submitted, not yet holding the lock (a local supervisor starting, a queued Slurm job):
    pending = JobRecord(id="mlp-queued", name="mlp", scheduler="local", submitted=time.time(), total_steps=60,
                        run_dir=str(run_dir), details={"host": os.uname().nodename, "pid": os.getpid(),
                                                       "pid_start": process_start(os.getpid())})
    registry.save(pending, state)
    r = cli_here("submit", MLP, "--run-dir", run_dir)
    assert_one_line_error(r, "belongs to job mlp-queued, which is pending", "elastic-harness stop mlp-queued")
    assert sorted(p.name for p in run_dir.iterdir()) == [], "nothing was started or written"


def test_a_supervisor_that_died_is_reported_not_running(cli_here, state, tmp_path):
    """A real process that exited without recording an exit (as a SIGKILLed supervisor)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "events.jsonl").write_text(json.dumps({"t": 1.0, "event": "start", "pid": proc.pid, "who": "host",
                                                      "run_id": "mlp-gone"}) + "\n")
    registry.save(JobRecord(id="mlp-gone", name="mlp", scheduler="local", submitted=1.0, total_steps=60,
                            run_dir=str(run_dir), details={"host": os.uname().nodename, "pid": proc.pid,
                                                           "pid_start": "1"}), state)
    r = cli_here("status", "mlp-gone", "--json")
    st = json.loads(r.out)
    assert (r.code, st["state"]) == (0, "failed")
    assert st["reason"] == f"supervisor pid {proc.pid} on {os.uname().nodename} is gone, without recording an exit"
    r = cli_here("stop", "mlp-gone")
    assert r.code == 0 and "job mlp-gone is not running: it failed" in r.out
