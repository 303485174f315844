"""A second job on a run directory that a running job holds is refused with one line naming
the first (``run`` and ``agent`` alike), and the lock goes away when the first job ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from elastic_harness.checkpoint.lock import LOCK_FILE
from tests.conftest import MLP, REPO, cli, read_jsonl

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def test_second_job_is_refused_naming_the_first(tmp_path):
    run_dir = tmp_path / "run"
    first = subprocess.Popen(
        [sys.executable, "-m", "elastic_harness", "run", str(MLP), "--set", "train.steps=100000",
         "--set", "checkpoint.every_steps=0", "--set", "checkpoint.save_final=false", "--run-dir", str(run_dir)],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not any(e["event"] == "step" for e in read_jsonl(run_dir / "events.jsonl")):
            assert first.poll() is None, "the first job ended early"
            assert time.monotonic() < deadline, "the first job never trained"
            time.sleep(0.2)
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
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGTERM)  # `run` drains its nodes and releases its locks
        try:
            first.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    assert not (run_dir / LOCK_FILE).exists()
