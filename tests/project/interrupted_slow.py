"""Slow on purpose, and not collected by the suite (its name does not start with ``test_``):
``test_interrupt.py`` runs one of these in a pytest of its own and sends that pytest SIGINT
while the test waits on what it started.

``EH_INTERRUPT_READY``: a directory outside this pytest's temp dir, where each rank says it
started and the command's job keeps its record and run directory (both must outlast this
pytest: a command that loses them ends by itself);
``EH_INTERRUPT_TOKEN``: the job id the command is given (its command line names it);
``EH_INTERRUPT_HOLDER``: a live pid to record as that job's supervisor, so that ``logs -f``
follows it until stopped.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from tests.conftest import cli
from tests.servers import spawn_ranks

pytestmark = pytest.mark.timeout(900)
LONG_S = 600


def _rank_that_takes_long(rank: int, port: int, root: str) -> None:
    Path(os.environ["EH_INTERRUPT_READY"], f"rank{rank}").write_text(str(os.getpid()))
    time.sleep(LONG_S)


def test_ranks_that_take_long(tmp_path):
    spawn_ranks(_rank_that_takes_long, tmp_path)


def test_a_command_that_takes_long():
    from elastic_harness.checkpoint.lock import process_start
    from elastic_harness.lifecycle import registry
    from elastic_harness.lifecycle.registry import JobRecord

    holder, kept = int(os.environ["EH_INTERRUPT_HOLDER"]), Path(os.environ["EH_INTERRUPT_READY"])
    record = JobRecord(id=os.environ["EH_INTERRUPT_TOKEN"], name="slow", scheduler="local",
                       submitted=time.time(), total_steps=1, run_dir=str(kept),
                       details={"host": socket.gethostname(), "pid": holder, "pid_start": process_start(holder)})
    registry.save(record, kept / "state")
    cli("logs", "-f", record.id, timeout=LONG_S, env={registry.STATE_VAR: str(kept / "state")})
