"""A run leaves nothing in the system temp dir or /dev/shm, even when SIGKILLed as a whole.

The runs get their own ``TMPDIR`` (an empty test dir), so other activity on the machine
cannot confuse the check; ``test_torch_writes_to_tmpdir`` proves that torch and torchelastic
honour it, which is what makes an empty ``TMPDIR`` afterwards mean something.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_harness.launch.scratch import stale_fifos, torch_environ, watchdog_fifo
from tests.conftest import MLP, REPO, cli, read_jsonl
from tests.servers import wait_until

SHM = Path("/dev/shm")


@pytest.fixture(autouse=True)
def _no_inherited_inductor_cache(monkeypatch):
    """Importing torch._dynamo sets TORCHINDUCTOR_CACHE_DIR in its own process (to
    /tmp/torchinductor_$USER): once an earlier test in this process did, the subprocesses
    here would inherit it, and a run rightly keeps a cache dir it is given."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)


def test_torch_caches_go_to_the_run_dir_unless_the_user_chose():
    env = torch_environ(Path("/runs/a"), {})
    assert env == {"TORCHINDUCTOR_CACHE_DIR": "/runs/a/cache/torchinductor"}
    assert torch_environ(Path("/runs/a"), {"TORCHINDUCTOR_CACHE_DIR": "/fast/cache"}) == {}


def test_only_dead_agents_fifos_on_this_host_are_stale():
    mine = watchdog_fifo(Path("/r"), "node-a", 41)
    assert mine == Path("/r/tmp/watchdog-node-a-41.fifo")
    names = [mine.name, "watchdog-node-a-42.fifo", "watchdog-node-b-43.fifo", "notes.txt",
             "watchdog-node-a-x.fifo"]
    assert stale_fifos(names, "node-a", alive=lambda pid: pid == 42) == [mine.name]
    assert stale_fifos(names, "node-b", alive=lambda pid: False) == ["watchdog-node-b-43.fifo"]


@pytest.mark.e2e  # the control of the e2e test below; imports torch in a subprocess
@pytest.mark.timeout(120)
def test_torch_writes_to_tmpdir(tmp_path):
    """The control: with TMPDIR set, torchelastic's default log dir and torch's compile cache
    land in it. Were TMPDIR ignored, the tests below would pass without proving anything."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    code = ("from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs\n"
            "print(DefaultLogsSpecs().root_log_dir)\n"
            "import torch._dynamo\n")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TMPDIR": str(tmp)},
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(tmp / "torchelastic_"))
    assert {p.name.split("_")[0] for p in tmp.iterdir()} == {"torchelastic", "torchinductor"}


def _new_entries(tmp: Path, shm_before: set[str]) -> list[str]:
    return sorted(p.name for p in tmp.iterdir()) + sorted(set(os.listdir(SHM)) - shm_before)


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        out.add(pid)
        todo += children.get(pid, [])
    return out


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_runs_leave_nothing_in_the_temp_dir_even_when_sigkilled(tmp_path):
    """SIGKILL the whole ``run`` process group mid-training: nothing gets to clean up. Its
    agents and workers die by parent-death signal; the temp dir must still be empty. Then a
    run that ends normally in the same dir: nothing either, and it removes the dead agent's
    FIFO from ``RUN_DIR/tmp``."""
    tmp, run_dir = tmp_path / "tmp", tmp_path / "run"
    tmp.mkdir()
    shm = set(os.listdir(SHM))
    env = {**os.environ, "TMPDIR": str(tmp)}
    cmd = [sys.executable, "-m", "elastic_harness", "run", str(MLP), "--run-dir", str(run_dir),
           "--set", "train.steps=100000", "--set", "checkpoint.every_steps=5"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: any(e["event"] == "checkpoint" for e in read_jsonl(run_dir / "events.jsonl")),
                   180, "a checkpoint of the run to be killed")
        tree = _descendants(proc.pid)
        assert len(tree) >= 5, tree  # run, agent, its zygote, two workers
        assert [p.name for p in (run_dir / "tmp").iterdir()][0].startswith("watchdog-")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    wait_until(lambda: not any(_running(p) for p in tree), 60, "the killed run's processes to end")
    assert _new_entries(tmp, shm) == []
    saved = max(e["step"] for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "checkpoint")
    # A few steps past any checkpoint that committed without its event before the kill.
    again = cli("run", str(MLP), "--set", f"train.steps={saved + 12}", run_dir=run_dir,
                env={"TMPDIR": str(tmp)})
    assert again.code == 0, again.err
    assert _new_entries(tmp, shm) == []
    assert not (run_dir / "tmp").exists(), list((run_dir / "tmp").iterdir())
    assert (run_dir / "cache" / "torchinductor").is_dir()  # torch did write; just not to /tmp


@pytest.mark.e2e  # imports torch and the quickstart's task in a subprocess
@pytest.mark.timeout(120)
def test_building_the_model_in_the_host_leaves_nothing_in_the_temp_dir(tmp_path):
    """The host builds the task's model once before any agent (``run``, ``submit``, ``spec``):
    the quickstart's task imports torch's compiler, which made its cache dir in the temp dir."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = subprocess.run([sys.executable, "-m", "elastic_harness", "spec", str(REPO / "jobs/quickstart.yaml")],
                         env={**os.environ, "TMPDIR": str(tmp)}, capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in tmp.iterdir()) == []
