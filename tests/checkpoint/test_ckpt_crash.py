"""SIGKILL in the middle of a save (sync and async): the resume uses the previous checkpoint.

No test hook slows the save down: the model is made big enough (about 40 MB of state) that
a save takes a while, and the whole process tree (CLI, agent, workers) is SIGKILLed as soon
as the step directory exists without its manifest, i.e. while DCP is writing it. The test
then checks the kill really landed mid-save before asserting anything else.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import MLP, REPO, cli
from tests.lanes import DETECTION

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

BIG = ["--set", "task.args.hidden=1024", "--set", "task.args.depth=4", "--set", "train.steps=15",
       "--set", "checkpoint.every_steps=5", "--set", "checkpoint.keep=3"]
KILL_AT = "step-0000010"


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (agents and workers run in their own sessions)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_mid_save(run_dir: Path, *sets: str) -> Path:
    """Start a run; SIGKILL everything once ``KILL_AT`` exists without a manifest."""
    cmd = [sys.executable, "-m", "elastic_harness", "run", str(MLP), *BIG, *sets, "--run-dir", str(run_dir)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    step_dir = run_dir / "checkpoints" / KILL_AT
    tree: list[int] = []
    try:
        deadline = time.monotonic() + 150
        while not (step_dir.is_dir() and not (step_dir / "manifest.json").exists()):
            assert proc.poll() is None, "the run ended before the save could be interrupted"
            assert time.monotonic() < deadline, "the save never started"
            time.sleep(0.001)
        tree = descendants(proc.pid)
        for pid in [*reversed(tree), proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 30
    while any(alive(p) for p in tree):
        assert time.monotonic() < deadline, "killed processes linger"
        time.sleep(0.05)
    return step_dir


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    r = cli("run", str(MLP), *BIG, "--set", "checkpoint.async_save=false",
            run_dir=tmp_path_factory.mktemp("big-ref"), timeout=180)
    assert r.code == 0, r.err
    return r.summary["model_digest"]


@pytest.mark.xdist_group("ckpt-crash-reference")  # computed once, on one worker
@pytest.mark.parametrize("async_save", ["false", "true"])
def test_sigkill_during_save_resumes_from_previous_checkpoint(tmp_path, reference, async_save):
    mode = ["--set", f"checkpoint.async_save={async_save}"]
    step_dir = kill_mid_save(tmp_path, *mode)
    assert step_dir.is_dir() and not (step_dir / "manifest.json").exists(), "kill did not land mid-save"
    done = [p.name for p in (tmp_path / "checkpoints").iterdir() if (p / "manifest.json").exists()]
    assert "step-0000005" in done and KILL_AT not in done
    again = cli("run", str(MLP), *BIG, *mode, run_dir=tmp_path, timeout=180)
    assert again.code == 0, again.err
    resumes = again.kinds("resume")
    assert resumes[-1]["step"] == 5 and resumes[-1]["checkpoint"] == "step-0000005"
    warnings = [w["message"] for w in again.kinds("warning")]
    assert any(f"ignoring incomplete checkpoint {KILL_AT}" in w for w in warnings), warnings
    assert any(f"removing stale incomplete {KILL_AT}" in w for w in warnings), warnings
    assert again.summary["model_digest"] == reference  # exactly the uninterrupted result
    assert (step_dir / "manifest.json").exists()  # step 10 re-saved cleanly on the way


@DETECTION
def test_a_worker_frozen_inside_a_save_is_killed_by_its_watchdog_not_its_peers_timeout(tmp_path):
    """Rank 1 frozen (SIGSTOP) in the middle of a synchronous save, saves every 5 steps (issue
    42): every save's watchdog budget was the process group's timeout, so the frozen worker
    outlived its healthy peer's collective (gloo's 120 s), and rank 0 was blamed ("Timed
    out"). Now a save's budget is measured from the earlier saves: the frozen worker's own
    watchdog kills it (a ``hang`` failure, state stopped), and the job recovers and finishes."""
    run_dir = tmp_path / "run"
    sets = ["--set", "checkpoint.async_save=false", "--set", "timeouts.step=10", "--set", "train.steps=40"]
    cmd = [sys.executable, "-m", "elastic_harness", "run", str(MLP), *BIG, *sets, "--run-dir", str(run_dir)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    step_dir = run_dir / "checkpoints" / KILL_AT  # the second save: the first was measured
    try:
        deadline = time.monotonic() + 150
        while not (step_dir.is_dir() and not (step_dir / "manifest.json").exists()):
            assert proc.poll() is None, "the run ended before the save could be interrupted"
            assert time.monotonic() < deadline, "the save never started"
            time.sleep(0.001)
        events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line]
        (frozen,) = [e["pid"] for e in events if e["event"] == "worker" and e["rank"] == 1][-1:]
        os.kill(frozen, signal.SIGSTOP)
        frozen_mid_save = not (step_dir / "manifest.json").exists()
        out, err = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert frozen_mid_save, "the freeze did not land mid-save"
    assert proc.returncode == 0, err
    failures = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()
                if '"failure"' in line]
    hung = [f for f in failures if f.get("cause") == "hang" and f.get("rank") == 1]
    assert hung and hung[0]["state"] == "T", failures
    assert not [f for f in failures if "timed out" in (f.get("message") or "").lower()], failures
