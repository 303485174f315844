"""The suite's lanes under pytest-xdist (``tests/lanes.py``), in a pytest of its own with two
workers (``lanes_beside.py``): an ``alone`` test never runs beside another, each watching for
the other while it runs (without the lock they see each other); and the two tests of one
``xdist_group`` run on one worker (pytest 9.2 made xdist 3.8 ignore the groups silently)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(120)
BESIDE = Path(__file__).with_name("lanes_beside.py")


def test_an_alone_test_never_runs_beside_another_and_a_group_keeps_to_one_worker(tmp_path):
    seen = tmp_path / "seen"
    seen.mkdir()
    # The lanes plugin alone, not the suite's conftest (whose fixtures import torch in each worker)
    cmd = [sys.executable, "-m", "pytest", str(BESIDE), "-n", "2", "--dist", "loadgroup", "--noconftest",
           "-p", "tests.lanes", "-p", "no:cacheprovider", "-q", "--basetemp", str(tmp_path / "inner")]
    r = subprocess.run(cmd, cwd=REPO, env={**os.environ, "EH_LANES_DIR": str(seen)}, capture_output=True, text=True,
                       timeout=100)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    alone, one, two = (json.loads((seen / f"{name}.json").read_text()) for name in ("alone", "beside1", "beside2"))
    assert one["worker"] == two["worker"], "the group was split over the workers"
    assert alone["worker"] != one["worker"], "everything ran on one worker: nothing was tested"
    assert not alone["saw"] and not one["saw"] and not two["saw"], (alone, one, two)
