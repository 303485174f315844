"""Not collected by the suite (its name does not start with ``test_``): ``test_lanes.py`` runs
these in a pytest of its own with two xdist workers (``--dist loadgroup``). The two ``beside``
tests are one group; each test says it is running (a file in ``EH_LANES_DIR``) for a window
and records its worker, and whether it saw a test of the other kind running meanwhile."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)
WINDOW_S = 1.5  # how long each looks for the other kind: both start at once on two idle workers


def _look_for(me: str, other: str) -> None:
    where = Path(os.environ["EH_LANES_DIR"])
    running = where / f"{me}.running"
    running.touch()
    deadline = time.monotonic() + WINDOW_S
    saw = any(where.glob(f"{other}*.running"))
    while not saw and time.monotonic() < deadline:
        time.sleep(0.05)
        saw = any(where.glob(f"{other}*.running"))
    running.unlink()
    (where / f"{me}.json").write_text(json.dumps({"saw": saw, "worker": os.environ["PYTEST_XDIST_WORKER"]}))


@pytest.mark.alone
def test_alone():
    _look_for("alone", "beside")


@pytest.mark.xdist_group("beside")
@pytest.mark.parametrize("n", [1, 2])
def test_beside(n):
    _look_for(f"beside{n}", "alone")
