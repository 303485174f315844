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
import threading
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


def test_only_fifos_whose_lock_nobody_holds_are_stale():
    mine = watchdog_fifo(Path("/r"), "00aa11bb22cc33dd")
    assert mine == Path("/r/tmp/watchdog-00aa11bb22cc33dd.fifo")
    names = [mine.name, "watchdog-00aa11bb22cc33dd.lock", "watchdog-0123456789abcdef.fifo",
             "watchdog-0123456789abcdef.lock", "watchdog-fedcba9876543210.fifo",  # no lock yet
             "notes.txt", "watchdog-node-a-41.fifo", "watchdog-node-a-41.lock"]
    held = {"watchdog-0123456789abcdef.lock"}
    assert stale_fifos(names, held=lambda lock: lock in held) == [mine.name]
    assert stale_fifos(names, held=lambda lock: True) == []


@pytest.mark.timeout(60)
def test_a_live_agents_fifo_survives_another_agent_starting(tmp_path):
    """The clash of issue 36: agents sharing a run dir from different pid namespaces with one
    host name took each other's FIFOs (named by host and pid) for stale ones. A FIFO goes
    only when its lock is free: here held by another live process (any namespace, any pid),
    while a dead agent's lock is free."""
    from elastic_harness.agent import watchdog

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    live, dead = watchdog_fifo(tmp_path, "1" * 16), watchdog_fifo(tmp_path, "2" * 16)
    for fifo in (live, dead):
        os.mkfifo(fifo)
        fifo.with_suffix(".lock").touch()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX); "
        "print('held', flush=True); sys.stdin.read()"), str(live.with_suffix(".lock"))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        server = watchdog.start("run-x", tmp_path)
        try:
            names = {p.name for p in tmp.iterdir()}
            assert live.name in names and live.with_suffix(".lock").name in names
            assert dead.name not in names and dead.with_suffix(".lock").name not in names
            assert os.environ["TORCHELASTIC_TIMER_FILE"] != str(live)
        finally:
            server.stop()
            os.environ.pop("TORCHELASTIC_TIMER_FILE", None)
        assert {p.name for p in tmp.iterdir()} == {live.name, live.with_suffix(".lock").name}
    finally:
        holder.communicate("")


@pytest.mark.timeout(60)
def test_a_stopped_watchdog_leaves_no_thread_even_when_no_worker_wrote_to_it(tmp_path):
    """An agent whose workers never started stops a step watchdog nobody wrote to. torch's
    thread then waits in ``open()`` of the FIFO for a first writer, which removing the FIFO
    does not end: it stayed in the process for good (the pytest process too, for every test
    that started one)."""
    from elastic_harness.agent import watchdog

    before = set(threading.enumerate())
    server = watchdog.start("run-x", tmp_path)
    try:
        started = set(threading.enumerate()) - before
        assert started, "the watchdog's thread"
    finally:
        server.stop()
        os.environ.pop("TORCHELASTIC_TIMER_FILE", None)
    assert [t.name for t in started if t.is_alive()] == []
    assert not (tmp_path / "tmp").exists(), "its FIFO and lock are gone too"


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
@pytest.mark.alone  # it reads /dev/shm, which the whole machine shares: no other test of ours writes there meanwhile
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
