"""The agent's HTTP endpoint and live fault injection into a running job."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from elastic_harness.agent.endpoint import Endpoint, Serving, health_verdict, stall_bound
from elastic_harness.commands.chaos import cmd_chaos
from elastic_harness.events import EventLog, EventTail
from elastic_harness.spec import parse_job
from tests.conftest import MLP, REPO, cli, read_jsonl
from tests.servers import free_port, wait_until


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metrics(base: str) -> dict[str, tuple[float, dict]]:
    """name -> (value, labels) of every sample on /metrics, parsed by prometheus_client."""
    status, text = get(base + "/metrics")
    assert status == 200
    return {s.name: (s.value, s.labels) for f in text_string_to_metric_families(text) for s in f.samples}


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def generation(log: EventLog, pid: int, resume: int, last: int, world: int = 2) -> None:
    """One worker generation as rank 0 and node n0's workers narrate it."""
    for rank in range(world):
        log.emit("worker", rank=rank, local_rank=0 if rank == 0 else 1, node="n0", world_size=world)
    log.emit("rendezvous", world_size=world)
    log.emit("resume", step=resume, world_size=world, fresh=resume == 0)
    for step in range(resume + 1, last + 1):
        log.emit("step", step=step, loss=1.0 / step, world_size=world, step_s=0.01)


@pytest.fixture
def served(tmp_path):
    """An endpoint on an empty log whose reader runs only when the test calls refresh()."""
    path = tmp_path / "events.jsonl"
    clock = FakeClock()
    ep = Endpoint(path, job="mlp", node="n0", serving=Serving(stall_s=50.0, refresh_s=3600, clock=clock))
    try:
        yield ep, EventLog(path), f"http://127.0.0.1:{ep.port}", clock
    finally:
        ep.close()


def test_health_verdict_and_its_default_bound():
    assert health_verdict(None, quiet_s=10, stall_s=50, finished=False) == (True, "ok")
    assert health_verdict((False, "workers FAILED"), 0, 50, False) == (False, "agent: workers FAILED")
    assert not health_verdict(None, quiet_s=51, stall_s=50, finished=False)[0]
    assert health_verdict(None, quiet_s=51, stall_s=50, finished=True)[0], "a finished job is not stuck"
    assert health_verdict(None, quiet_s=1e6, stall_s=None, finished=False)[0]
    spec = parse_job("task: {target: 'a.b:C'}\ntrain: {log_every: 5}\ntimeouts: {step: 10, process_group: 60, shutdown_grace: 20}\n"
                     "rendezvous: {join_timeout: 100}")
    assert stall_bound(spec) == 100 + 60 + 20 + 5 * 10
    assert stall_bound(parse_job("task: {target: 'a.b:C'}\ntimeouts: {step: 0}")) is None


def test_endpoint_serves_this_nodes_counters_from_the_log(served):
    ep, log, base, _ = served
    log.emit("start", who="agent", node="n0")
    generation(log, 1, resume=0, last=25)
    log.emit("fault", kind="kill-worker", target=1, step=25, rank=1, node="n0")
    log.emit("fault", kind="kill-node", target=1, step=25, node="n1")
    ep.refresh()
    progress = json.loads(get(base + "/progress")[1])
    assert (progress["step"], progress["world_size"], progress["restarts"], progress["faults"]) == (25, 2, 0, 1)
    first = metrics(base)
    assert first["elastic_harness_steps_total"] == (25.0, {"job": "mlp", "node": "n0"})
    generation(log, 2, resume=20, last=30, world=1)  # restarted from step 20: the step goes back
    ep.refresh()
    after = metrics(base)
    assert after["elastic_harness_step"][0] == 30 and after["elastic_harness_world_size"][0] == 1
    assert after["elastic_harness_steps_total"][0] == 25 + 10, "counters only go up"
    assert after["elastic_harness_restarts_total"][0] == 1
    assert after["elastic_harness_faults_total"][0] == 1, "only the fault that hit this node"
    assert 0 < after["elastic_harness_goodput_ratio"][0] < 1
    assert after["elastic_harness_healthy"][0] == 1


def test_requests_never_read_the_log_and_slow_storage_is_not_a_stall(served):
    ep, log, base, clock = served
    generation(log, 1, resume=0, last=3)
    ep.refresh()
    reads, release = [], threading.Event()

    def stuck_read() -> list[dict]:
        reads.append(clock())
        release.wait(60)
        return []

    ep._tail.read = stuck_read
    for path in ("/healthz", "/progress", "/metrics"):
        assert get(base + path)[0] == 200
    assert reads == [], "requests are served from the folded state"
    clock.now = 45.0
    reader = threading.Thread(target=ep.refresh)
    reader.start()
    wait_until(lambda: reads, 30, "the read to start")
    clock.now = 500.0
    assert get(base + "/healthz") == (200, "ok\n"), "a read still in progress is not a stall"
    release.set()
    reader.join(30)
    status, text = get(base + "/healthz")
    assert status == 503 and "no new event for 500s" in text
    log.emit("finish", step=3, loss=0.1)
    ep._tail = EventTail(Path(log.path), start_at_end=False)  # follow the log again
    ep.refresh()
    assert get(base + "/healthz")[0] == 200
    ep.agent_health = lambda: (False, "workers made no progress for 90s")
    assert get(base + "/healthz") == (503, "agent: workers made no progress for 90s\n")


def handler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if "process_request_thread" in t.name]


def test_connections_beyond_the_bound_are_refused_not_queued(tmp_path):
    ep = Endpoint(tmp_path / "events.jsonl", job="j", node="n", serving=Serving(max_connections=2, idle_timeout_s=60))
    idle = []
    try:
        for _ in range(5):  # one at a time, so the first two are the ones the server keeps
            idle.append(socket.create_connection(("127.0.0.1", ep.port), timeout=30))
            wait_until(lambda: len(handler_threads()) == min(len(idle), 2) or len(idle) > 2, 30, "accept")
        for s in idle[2:]:
            assert s.recv(1) == b"", "refused at once, no thread"
        for s in idle[:2]:
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1)  # still open, each on its own handler thread
        assert len(handler_threads()) == 2
        for s in idle[:2]:
            s.close()
        wait_until(lambda: not handler_threads(), 30, "handler threads to end")
        assert get(f"http://127.0.0.1:{ep.port}/healthz") == (200, "ok\n")
    finally:
        for s in idle:
            s.close()
        ep.close()
        ep.close()


def test_an_idle_connection_is_dropped(tmp_path):
    ep = Endpoint(tmp_path / "events.jsonl", job="j", node="n", serving=Serving(idle_timeout_s=0.2))
    try:
        with socket.create_connection(("127.0.0.1", ep.port), timeout=30) as s:
            assert s.recv(1) == b"", "the server closed it after its idle timeout"
        wait_until(lambda: not handler_threads(), 30, "its handler thread to end")
    finally:
        ep.close()


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_agent_serves_health_progress_and_metrics(tmp_path):
    """The wiring, on a real agent: once it trains, SIGTERM it (a drain) instead of waiting
    for the end; the endpoint must not hold up that exit."""
    run_dir, out = tmp_path / "run", tmp_path / "agent.out"
    cmd = [sys.executable, "-m", "elastic_harness", "agent", str(MLP), "--run-dir", str(run_dir),
           "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "endpoint-test", "--is-host",
           "--node", "n0", "--endpoint-port", "0", "--set", "train.steps=5000"]
    with open(out, "w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    try:
        wait_until(lambda: "endpoint: http://127.0.0.1:" in out.read_text(), 60, "the endpoint line")
        base = out.read_text().split("endpoint: ", 1)[1].split()[0].rsplit("/", 1)[0]
        assert get(base + "/healthz") == (200, "ok\n")
        wait_until(lambda: json.loads(get(base + "/progress")[1])["step"] >= 5, 150, "training progress")
        progress = json.loads(get(base + "/progress")[1])
        assert (progress["world_size"], progress["restarts"], progress["node"]) == (2, 0, "n0")
        steps, labels = metrics(base)["elastic_harness_steps_total"]
        assert steps >= 5 and labels == {"job": "mlp", "node": "n0"}
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=120) == 143
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert [e["event"] for e in read_jsonl(run_dir / "events.jsonl")].count("drain") == 1


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_chaos_command_injects_into_a_running_job(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "elastic_harness", "run", str(MLP), "--run-dir", str(run_dir),
           "--set", "train.steps=150", "--set", "checkpoint.every_steps=20"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO,
                            start_new_session=True)
    try:
        steps = lambda: [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "step"]  # noqa: E731
        wait_until(lambda: len(steps()) >= 25, 150, "the job to reach step 25")
        # In-process (what the CLI calls), so no interpreter start-up delays the request.
        assert cmd_chaos(argparse.Namespace(k8s=False, target=str(run_dir), fault="kill-worker:1")) == 0
        assert proc.wait(timeout=200) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    events = read_jsonl(run_dir / "events.jsonl")
    (fault,) = [e for e in events if e["event"] == "fault"]
    assert fault["kind"] == "kill-worker" and fault["target"] == 1 and fault["node"] == "0"
    resumes = [e for e in events if e["event"] == "resume"]
    assert len(resumes) == 2 and resumes[1]["step"] >= 20
    after = cli("chaos", str(run_dir), "kill-worker:1", timeout=30)
    assert after.code == 2 and "not running" in after.err
