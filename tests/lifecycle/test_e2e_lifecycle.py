"""Job lifecycle on this machine, end to end through the real CLI, agent and workers.

The job is the MLP reference job (``mlp_reference``) with a synchronous checkpoint after every
step, which changes no parameter (the tests compare digests) but makes steps slow enough to
interrupt in the middle. Waits poll the run's events, bounded; nothing sleeps to synchronise.
Every job a test submits is killed at teardown if it is still active.
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import signal
import subprocess
import sys

import pytest

from elastic_harness.checkpoint.lock import pid_alive
from tests.conftest import MLP, REPO, cli, read_jsonl
from tests.servers import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SLOW = ["--set", "checkpoint.every_steps=1", "--set", "checkpoint.async_save=false"]
JOB_ID = re.compile(r"\bmlp-[0-9a-f]{12}\b")


@pytest.fixture
def jobs():
    """Ids of the jobs a test submitted: any still active at the end is killed."""
    ids: list[str] = []
    yield ids
    for job in ids:
        cli("stop", "--now", job, timeout=120)


def events_of_job(run_dir, job_id: str) -> list[dict]:
    """The run's events from the newest start of ``job_id``'s host on."""
    events = read_jsonl(run_dir / "events.jsonl")
    starts = [i for i, e in enumerate(events) if e["event"] == "start" and e.get("who") == "host"
              and e.get("run_id") == job_id]
    return events[starts[-1]:] if starts else []


def steps_of(run_dir, job_id: str) -> list[int]:
    return [e["step"] for e in events_of_job(run_dir, job_id) if e["event"] == "step"]


def status(job: str) -> dict:
    r = cli("status", job, "--json", timeout=60)
    assert r.code == 0, r.err
    return json.loads(r.out)


def submit_in_a_terminal_then_close_it(run_dir) -> str:
    """``submit`` from a shell on a pseudo-terminal; then the terminal goes away (SIGHUP to
    its session), as when an SSH connection drops. Returns the job id."""
    cmd = f"{sys.executable} -m elastic_harness submit {MLP} --run-dir {run_dir} {' '.join(SLOW)}; read line"
    pid, fd = pty.fork()
    if pid == 0:  # the child: a shell whose controlling terminal is the pty
        os.chdir(REPO)
        os.execvp("bash", ["bash", "-c", cmd])
    out = b""
    try:
        while not JOB_ID.search(out.decode(errors="replace")):
            chunk = os.read(fd, 4096)
            assert chunk, f"submit printed no job id: {out!r}"
            out += chunk
    finally:
        os.close(fd)  # hang up: the shell (the session leader) gets SIGHUP
    wait_until(lambda: os.waitpid(pid, os.WNOHANG)[0] == pid, 30, "the shell to hang up")
    return JOB_ID.search(out.decode())[0]


def test_interrupt_submit_survive_the_terminal_stop_resubmit_and_finish(mlp_reference, tmp_path, jobs):
    run_dir = tmp_path / "run"
    # 1. Ctrl-C of an attached `run`: the terminal sends SIGINT to its foreground group (run;
    # its agents have sessions of their own). It drains, saves and records the exit.
    proc = subprocess.Popen([sys.executable, "-m", "elastic_harness", "run", str(MLP), "--run-dir", str(run_dir), *SLOW],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_until(lambda: any(e["event"] == "step" and e["step"] >= 3 for e in read_jsonl(run_dir / "events.jsonl")),
                   240, "the attached run to train")
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    drained = [e["step"] for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "drain"]
    assert len(drained) == 1 and f"job stopped by SIGINT; drained and saved at step {drained[0]}" in err
    assert (run_dir / "checkpoints" / f"step-{drained[0]:07d}" / "manifest.json").exists()
    first = status(str(run_dir))  # a run dir names its newest job; `run` registered itself
    assert (first["state"], first["step"], first["exit_code"]) == ("stopped", drained[0], 130)
    assert first["reason"] == f"interrupted (SIGINT); drained and saved at step {drained[0]}"

    # 2. Submitted from a terminal that then closes: the supervisor has its own session.
    job = submit_in_a_terminal_then_close_it(run_dir)
    jobs.append(job)
    wait_until(lambda: len(steps_of(run_dir, job)) >= 3, 240, "the submitted job to train after the hangup")
    running = status(job)
    assert running["state"] == "running" and running["recoveries"] == 1 and running["world_size"] == 2
    assert running["nodes"] == 1 and running["total_steps"] == 60

    # 3. A graceful stop: every rank finishes its step and saves; the job is `stopped`.
    stop = cli("stop", job, timeout=300)
    assert stop.code == 0, stop.err
    second = status(job)
    k = second["last_checkpoint_step"]
    assert second["state"] == "stopped" and second["step"] == k > drained[0]
    assert stop.out.strip() == f"{job} stopped: on request; drained and saved at step {k}"
    again = cli("stop", job, timeout=60)
    assert again.code == 0 and f"job {job} is not running: it was stopped" in again.out, "stop is idempotent"

    # 4. Submitted again, then `stop --now`: the supervisor's agent and workers are killed,
    # by the pids the job recorded (folded in here: one job start instead of a test's own).
    r = cli("submit", str(MLP), "--run-dir", str(run_dir), *SLOW, "--json", timeout=120)
    assert r.code == 0, r.err
    killed = json.loads(r.out)["id"]
    jobs.append(killed)
    wait_until(lambda: len(steps_of(run_dir, killed)) >= 1, 240, "the resubmitted job to train")
    pids = {e["pid"] for e in events_of_job(run_dir, killed)
            if e["event"] == "worker" or (e["event"] == "start" and e.get("who") == "agent")}
    assert len(pids) == 3, "an agent and two workers"
    # Hold the workers still (SIGSTOP, by the pids this job recorded) so the job cannot finish
    # its last steps while `stop --now` starts up on a loaded machine; SIGKILL still ends them.
    for e in events_of_job(run_dir, killed):
        if e["event"] == "worker":
            with contextlib.suppress(ProcessLookupError):
                os.kill(e["pid"], signal.SIGSTOP)
    now = cli("stop", "--now", killed, timeout=120)
    assert now.code == 0, now.err
    assert now.out.strip() == f"{killed} stopped: killed on request (stop --now)"
    wait_until(lambda: not any(pid_alive({"pid": p}) for p in pids), 60, "every agent and worker to be gone")
    assert status(killed)["state"] == "stopped"

    # 5. Submitting the same job again resumes it (from the newest checkpoint the kill left
    # intact); its logs are followed to the end.
    r = cli("submit", str(MLP), "--run-dir", str(run_dir), *SLOW, timeout=120)
    assert r.code == 0, r.err
    last = r.out.strip()
    jobs.append(last)
    logs = cli("logs", "-f", last, timeout=400)
    assert logs.code == 0, logs.err
    lines = logs.out.splitlines()
    resumed = re.search(r"\[supervisor\] resumed from step (\d+), saved at world size 2, now 2", " ".join(lines))
    assert resumed and int(resumed[1]) >= k, lines
    assert any(line.startswith(f"[node 0 agent] === elastic-harness agent: node 0, job {last}") for line in lines)
    assert not any(job in line for line in lines), "only this submission's sections"
    done = status(last)
    assert (done["state"], done["step"], done["recoveries"]) == ("succeeded", 60, 1)
    assert done["model_digest"] == mlp_reference.summary["model_digest"], "the same model as never stopped"
    assert f"[supervisor] model digest {done['model_digest']}" in lines, "followed to the supervisor's end"
    listed = {j["id"]: j["state"] for j in json.loads(cli("list", "--json", timeout=60).out)
              if j["run_dir"] == str(run_dir)}
    assert sorted(listed.values()) == ["stopped"] * 3 + ["succeeded"] and listed[job] == "stopped"

