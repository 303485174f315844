"""``@pytest.mark.alone`` under pytest-xdist (``tests/lanes.py``): with two workers free, an
``alone`` test and an ordinary one never run at the same time. Each runs on its own worker
and watches for the other while it runs (``lanes_beside.py``); without the lock both see
each other."""

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


def test_an_alone_test_never_runs_beside_another(tmp_path):
    seen = tmp_path / "seen"
    seen.mkdir()
    # The lanes plugin alone, not the suite's conftest (whose fixtures import torch in each worker)
    cmd = [sys.executable, "-m", "pytest", str(BESIDE), "-n", "2", "--dist", "loadgroup", "--noconftest",
           "-p", "tests.lanes", "-p", "no:cacheprovider", "-q", "--basetemp", str(tmp_path / "inner")]
    r = subprocess.run(cmd, cwd=REPO, env={**os.environ, "EH_LANES_DIR": str(seen)}, capture_output=True, text=True,
                       timeout=100)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    alone, beside = (json.loads((seen / f"{name}.json").read_text()) for name in ("alone", "beside"))
    assert alone["worker"] != beside["worker"], "both ran on one worker: nothing was tested"
    assert not alone["saw"] and not beside["saw"], (alone, beside)
