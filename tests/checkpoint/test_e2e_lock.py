"""A second job on a run directory that a running job holds is refused with one line naming
the first (``run`` and ``agent`` alike), and the lock goes away when the first job ends."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from elastic_harness import exitcodes
from elastic_harness.checkpoint.lock import LOCK_FILE
from tests.conftest import MLP, REPO, cli, read_jsonl, training_in_background
from tests.servers import wait_until
from tests.sockets import descendants

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def test_second_job_is_refused_naming_the_first(tmp_path):
    run_dir = tmp_path / "run"
    with training_in_background(run_dir) as first:
        holder = json.loads((run_dir / LOCK_FILE).read_text())
        assert holder["pid"] == first.pid and holder["job"] == "mlp"

        second = cli("run", str(MLP), run_dir=run_dir, timeout=120)
        assert second.code == 2 and "Traceback" not in second.err
        line, fix = second.err.strip().splitlines()
        assert line.startswith(f"error: run directory '{run_dir}' is in use by job 'mlp' "
                               f"(rendezvous id {holder['rdzv_id']}, pid {first.pid} on host ")
        assert fix.startswith("  fix: ")
        agent = cli("agent", str(MLP), "--rdzv-id", "another-job", "--rdzv-endpoint", "127.0.0.1:1",
                    run_dir=run_dir, timeout=120)
        assert agent.code == 2 and f"pid {first.pid}" in agent.err and "Traceback" not in agent.err
    assert not (run_dir / LOCK_FILE).exists()


def test_a_job_whose_lock_was_taken_over_stops_without_saving_and_the_holder_is_never_fenced(tmp_path):
    """Job A is frozen, its lock made to look stale from another host, and job B takes the
    run dir over and resumes. Then A thaws (issue 42): its restart bumped the generation and
    fenced B out (B's saves refused to the end, exit 1) while A finished with 0. Now A finds
    its lock lost and stops (exit 2, one line) without a save, and B's saves all commit."""
    run_dir = tmp_path / "run"
    a_cmd = [sys.executable, "-m", "elastic_harness", "run", str(MLP), "--run-dir", str(run_dir),
             "--set", "train.steps=100000", "--set", "checkpoint.every_steps=5", "--set", "timeouts.step=10"]
    a = subprocess.Popen(a_cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    b = None
    try:
        events = lambda: read_jsonl(run_dir / "events.jsonl")  # noqa: E731
        wait_until(lambda: any(e["event"] == "checkpoint" for e in events()) or a.poll() is not None, 180,
                   "job A's first checkpoint")
        frozen = descendants(a.pid)  # its host, agent, zygote and workers (each agent has a session of its own)
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        record = json.loads((run_dir / LOCK_FILE).read_text())
        record.update(host="elsewhere", beat=time.time() - 3600)  # A looks gone, seen from another host
        (run_dir / LOCK_FILE).write_text(json.dumps(record))
        b = subprocess.Popen([*a_cmd[:-6], "--set", "train.steps=100000", "--set", "checkpoint.every_steps=5"],
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
        wait_until(lambda: b_steps(events(), b) >= 20 or b.poll() is not None, 180, "job B to resume and train")
        thawed = time.time()
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
        a_out, a_err = a.communicate(timeout=120)
        wait_until(lambda: b_steps(events(), b) >= 60 or b.poll() is not None, 120, "job B to train on")
        os.killpg(b.pid, signal.SIGTERM)  # B drains and saves: that save must commit too
        b_out, b_err = b.communicate(timeout=120)
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                for pid in descendants(p.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
                        os.kill(pid, signal.SIGKILL)
                p.wait()
    assert a.returncode == 2, a_err
    (line,) = [x for x in a_err.splitlines() if "lost the lock" in x]
    assert "stopped without saving" in line and "Traceback" not in a_err
    b_start = next(e["t"] for e in events() if e["event"] == "start" and e.get("pid") == b.pid)
    a_pids = {e["pid"] for e in events() if e["t"] < b_start}  # A's host, agents and workers
    assert not [e for e in events() if e["event"] == "checkpoint" and e["t"] > thawed and e["pid"] in a_pids], \
        "A committed a checkpoint after it lost the lock"
    assert not [e for e in events() if e["event"] == "fenced" and e["pid"] not in a_pids], "B's saves were refused"
    assert b.returncode == exitcodes.PREEMPTED, b_err


def b_steps(events: list[dict], b) -> int:
    """Steps trained by the workers B started (``worker`` events after B's ``start``)."""
    start = next((e["t"] for e in events if e["event"] == "start" and e.get("pid") == b.pid), None)
    workers = {e["pid"] for e in events if start is not None and e["event"] == "worker" and e["t"] >= start}
    return sum(1 for e in events if e["event"] == "step" and e["pid"] in workers)
