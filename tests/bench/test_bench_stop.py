"""A bench stopped by SIGTERM (a CI runner's timeout, ``kill``) leaves nothing behind: its
runs are stopped and its scratch directory removed, as after Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.project.test_interrupt import survivors
from tests.servers import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def test_sigterm_mid_bench_stops_its_runs_and_removes_its_scratch(tmp_path):
    scratch_parent = tmp_path / "scratch"
    scratch_parent.mkdir()
    cmd = [sys.executable, "-m", "elastic_harness", "bench", "recovery", "--only", "kill-worker",
           "--dir", str(scratch_parent)]
    with open(tmp_path / "bench.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # under way: a run of the harness has written events in the bench's scratch
        wait_until(lambda: any(scratch_parent.rglob("events.jsonl")), 120, "the bench's first run")
        token = str(scratch_parent)
        assert survivors(-1, token), "the bench's runs name its scratch directory"
        os.kill(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert code == 128 + signal.SIGTERM, (tmp_path / "bench.log").read_text()[-2000:]
    assert list(scratch_parent.iterdir()) == []
    wait_until(lambda: not survivors(-1, token), 30, "every process of the bench's runs to end")
