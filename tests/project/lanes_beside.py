"""Not collected by the suite (its name does not start with ``test_``): ``test_lanes.py`` runs
these two in a pytest of its own with two xdist workers. Each says it is running (a file in
``EH_LANES_DIR``) for a window, and records whether it saw the other running in it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)
WINDOW_S = 2.0  # how long each looks for the other: both start at once on two idle workers


def _look_for(me: str, other: str) -> None:
    where = Path(os.environ["EH_LANES_DIR"])
    running = where / f"{me}.running"
    running.touch()
    deadline = time.monotonic() + WINDOW_S
    saw = (where / f"{other}.running").exists()
    while not saw and time.monotonic() < deadline:
        time.sleep(0.05)
        saw = (where / f"{other}.running").exists()
    running.unlink()
    (where / f"{me}.json").write_text(f'{{"saw": {str(saw).lower()}, "worker": "{os.environ["PYTEST_XDIST_WORKER"]}"}}')


@pytest.mark.alone
def test_alone():
    _look_for("alone", "beside")


def test_beside():
    _look_for("beside", "alone")
