"""The agent's HTTP endpoint and live fault injection into a running job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest

from elastic_harness.launch.endpoint import ProgressState
from tests.conftest import MLP, REPO, cli, read_jsonl
from tests.servers import free_port, wait_until

EVENTS = [
    {"t": 100.0, "event": "resume", "fresh": True, "world_size": 2},
    {"t": 101.0, "event": "step", "step": 1, "loss": 0.9, "world_size": 2, "step_s": 0.5},
    {"t": 102.0, "event": "checkpoint", "step": 1, "blocking_s": 0.1, "total_s": 0.4},
    {"t": 103.0, "event": "resume", "step": 1, "world_size": 1, "load_s": 0.2},
    {"t": 104.0, "event": "step", "step": 2, "loss": 0.7, "world_size": 1, "step_s": 1.5},
]


def test_progress_state_from_events():
    s = ProgressState()
    for e in EVENTS:
        s.update(e)
    p = s.progress(now=104.0)
    assert (p["step"], p["world_size"], p["restarts"], p["last_checkpoint_step"]) == (2, 1, 1, 1)
    assert p["goodput"] == pytest.approx(2.0 / 4.0)
    text = s.metrics(now=104.0)
    assert "elastic_harness_steps_total 2\n" in text
    assert "elastic_harness_restarts_total 1\n" in text
    assert "elastic_harness_checkpoint_load_seconds_total 0.2\n" in text
    assert "# TYPE elastic_harness_goodput_ratio gauge" in text


def get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status, r.read().decode()


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_agent_serves_health_progress_and_metrics(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "elastic_harness", "agent", str(MLP), "--run-dir", str(run_dir),
           "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "endpoint-test", "--is-host",
           "--node", "n0", "--endpoint-port", "0", "--set", "train.steps=400"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO, start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("endpoint: http://127.0.0.1:"), line
        base = line.split()[1].rsplit("/", 1)[0]
        assert get(base + "/healthz") == (200, "ok\n")
        wait_until(lambda: json.loads(get(base + "/progress")[1])["step"] >= 5, 120, "training progress")
        progress = json.loads(get(base + "/progress")[1])
        assert progress["world_size"] == 2 and progress["restarts"] == 0
        status, metrics = get(base + "/metrics")
        assert status == 200 and "elastic_harness_steps_total" in metrics
        assert proc.wait(timeout=150) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_chaos_command_injects_into_a_running_job(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "elastic_harness", "run", str(MLP), "--run-dir", str(run_dir),
           "--set", "train.steps=2000", "--set", "checkpoint.every_steps=50"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO,
                            start_new_session=True)
    try:
        steps = lambda: [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "step"]  # noqa: E731
        wait_until(lambda: len(steps()) >= 60, 120, "the job to reach step 60")
        injected = cli("chaos", str(run_dir), "kill-worker:1", timeout=30)
        assert injected.code == 0, injected.err
        assert proc.wait(timeout=200) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    events = read_jsonl(run_dir / "events.jsonl")
    (fault,) = [e for e in events if e["event"] == "fault"]
    assert fault["kind"] == "kill-worker" and fault["target"] == 1
    resumes = [e for e in events if e["event"] == "resume"]
    assert len(resumes) == 2 and resumes[1]["step"] >= 50
    after = cli("chaos", str(run_dir), "kill-worker:1", timeout=30)
    assert after.code == 2 and "not running" in after.err
