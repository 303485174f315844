"""A second job on a run directory that a running job holds is refused with one line naming
the first (``run`` and ``agent`` alike), and the lock goes away when the first job ends."""

from __future__ import annotations

import json

import pytest

from elastic_harness.checkpoint.lock import LOCK_FILE
from tests.conftest import MLP, cli, training_in_background

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
