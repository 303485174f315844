"""Shared helpers: run the real CLI in a subprocess, read what a run left behind.

Every subprocess runs in its own session, so a terminal's Ctrl-C reaches only pytest: its
process group is stopped when the test times out and when the wait ends any other way
(Ctrl-C's KeyboardInterrupt included, ``stop_group``), so nothing a test started outlives it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

# Under pytest-xdist: @pytest.mark.alone, and the order tests are handed out in (tests/lanes.py)
from tests.lanes import pytest_collection_modifyitems, pytest_runtest_protocol  # noqa: F401

KEEP_TMP_VAR = "ELASTIC_HARNESS_KEEP_TEST_TMP"


def pytest_configure(config: pytest.Config) -> None:
    """Test directories go in a fresh temp dir removed when the session ends (pytest's default
    keeps the last three sessions' under /tmp/pytest-of-USER). ``--basetemp`` or
    ``ELASTIC_HARNESS_KEEP_TEST_TMP=1`` keep them, to look at a failed run."""
    if config.option.basetemp is None and not os.environ.get(KEEP_TMP_VAR):
        config.option.basetemp = config._eh_basetemp = tempfile.mkdtemp(prefix="elastic-harness-tests-")
        # Importing torch._dynamo creates its cache dir (/tmp/torchinductor_USER by default).
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(config._eh_basetemp, "inductor"))


def pytest_unconfigure(config: pytest.Config) -> None:
    _end_rank_processes_left()
    path = getattr(config, "_eh_basetemp", None)
    if path:
        shutil.rmtree(path, ignore_errors=True)

def _end_rank_processes_left() -> None:
    """SIGKILL the ``multiprocessing`` children tests started and left running (a test that
    pytest-timeout ended while it waited for them): the interpreter's exit joins every one,
    and a rank blocked in a collective never ends (CI hung 40 minutes past the summary)."""
    import multiprocessing

    for proc in multiprocessing.active_children():
        with contextlib.suppress(OSError, ValueError):
            proc.kill()
            proc.join(10)


@pytest.fixture(autouse=True)
def _undo_torch_patches():
    """The patches ``torchcompat`` makes to torch's modules (an agent's ``create_handler``
    makes them in its own process) are undone after each test that made them."""
    yield
    rdzv = sys.modules.get("elastic_harness.torchcompat.rdzv")
    if rdzv is not None:
        rdzv.undo_module_patches()


# Names our code gives its threads (``threading.Thread(name=...)``, executors' prefixes).
HARNESS_THREADS = ("harness-", "endpoint", "isolation-watchdog", "isolated-report", "lock-heartbeat", "ckpt-",
                   "rendezvous-changes", "liveness-beacon", "agent-progress", "cpu-sampler")
THREAD_END_GRACE_S = 2.0  # a thread told to stop as its test ended gets this long to finish


def harness_thread(thread: threading.Thread) -> bool:
    """Did our code start ``thread``: one of our names, or the loop of one of our objects
    (the step watchdog runs torch's loop on ours; a test's thread running a handler's join)."""
    if thread.name.startswith(HARNESS_THREADS):
        return True
    owner = getattr(getattr(thread, "_target", None), "__self__", None)
    return owner is not None and type(owner).__module__.startswith("elastic_harness.")


@pytest.fixture(autouse=True)
def _no_harness_threads_left():
    """A test that leaves a thread of the harness running in the pytest process fails: every
    later test shares the process. Library singletons (tqdm's monitor, fsspec's loop) are
    not ours to stop and not counted. This process's liveness beacon (one per agent process,
    for the process's life: ``rendezvous.handler.close_beacon``) is closed first, as an agent's
    exit closes it."""
    before = set(threading.enumerate())
    yield
    handler = sys.modules.get("elastic_harness.rendezvous.handler")
    if handler is not None:
        handler.close_beacon()
    deadline = time.monotonic() + THREAD_END_GRACE_S
    left = []
    for thread in threading.enumerate():
        if thread not in before and harness_thread(thread):
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                left.append(thread.name)
    assert not left, f"the test left threads of the harness running in the pytest process: {', '.join(left)}"


REPO = Path(__file__).resolve().parents[1]
JOBS = REPO / "jobs"
MLP = JOBS / "mlp.yaml"


@dataclass
class Result:
    code: int
    out: str
    err: str
    run_dir: Path | None

    @property
    def events(self) -> list[dict]:
        return read_jsonl(self.run_dir / "events.jsonl")

    @property
    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())

    def kinds(self, kind: str) -> list[dict]:
        """Events of this kind from this invocation (a run dir accumulates invocations)."""
        from elastic_harness.records.summary import current_invocation

        return [e for e in current_invocation(self.events) if e["event"] == kind]

    def timeline(self, kinds: tuple[str, ...] = ("fault", "workers", "failure", "reformed", "rendezvous",
                                                 "recovery", "drain", "resume", "exit")) -> str:
        """This invocation's membership and failure events, a line each: an assertion's message
        when a count of rounds or recoveries is not what a test expected (CI keeps no run dir)."""
        from elastic_harness.records.summary import current_invocation

        keep = ("pid", "node", "rank", "state", "kind", "step", "restart", "world_size", "generation", "mode",
                "kept", "new", "forked", "code", "message", "reason")
        return "\n".join(f"{e['event']}: " + ", ".join(f"{k}={e[k]}" for k in keep if e.get(k) not in (None, ""))
                         for e in current_invocation(self.events) if e["event"] in kinds)


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def cli(*args: str, run_dir: Path | None = None, timeout: float = 240, cwd: Path | None = None,
        env: dict | None = None) -> Result:
    """Run ``elastic-harness ARGS`` to completion (bounded), killing its group on timeout."""
    cmd = [sys.executable, "-m", "elastic_harness", *args]
    if run_dir is not None:
        cmd += ["--run-dir", str(run_dir)]
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=cwd or REPO, env=full_env, start_new_session=True)
    out, err = communicate_bounded(proc, timeout, f"elastic-harness {' '.join(args)}")
    return Result(proc.returncode, out, err, run_dir)


def communicate_bounded(proc: subprocess.Popen, timeout: float, what: str) -> tuple:
    """``proc.communicate()`` within ``timeout``. Whatever ends the wait early (the timeout,
    which fails the test; Ctrl-C, which goes on up) stops ``proc``'s group first: it leads a
    session of its own, so nothing else would, and it would outlive pytest."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = stop_group(proc)
        pytest.fail(f"{what} timed out after {timeout}s\n{out}\n{err}")
    except BaseException:
        stop_group(proc)
        raise


def stop_group(proc: subprocess.Popen, grace_s: float = 60) -> tuple:
    """SIGTERM the process group ``proc`` leads (`run` then stops the nodes it started);
    SIGKILL it after ``grace_s``, or at once on another Ctrl-C. Its remaining output."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        return proc.communicate(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    return proc.communicate()


@pytest.fixture(scope="session", autouse=True)
def _job_registry(tmp_path_factory):
    """Every job the tests submit or `run` is registered here, not in the user's state dir
    (``lifecycle.registry``); subprocesses inherit it through the environment."""
    from elastic_harness.lifecycle.registry import STATE_VAR

    before = os.environ.get(STATE_VAR)
    os.environ[STATE_VAR] = str(tmp_path_factory.mktemp("job-registry"))
    yield
    if before is None:
        os.environ.pop(STATE_VAR, None)
    else:
        os.environ[STATE_VAR] = before


def _must_not_start(*args, **kwargs):
    raise AssertionError("bad input got as far as starting the work")


@pytest.fixture
def cli_here(capsys, tmp_path, monkeypatch):
    """Run ``elastic-harness ARGS`` in this process, in ``tmp_path``, without PET_* hints:
    for inputs that must be refused before any work starts (no torch import per call).

    The calls that would start training or a benchmark fail the test instead, so a bad
    input that is accepted cannot start a cluster inside the test process."""
    import elastic_harness.agent.node
    from elastic_harness.bench.checkpoint import main as checkpoint
    from elastic_harness.bench.recovery import main as recovery
    from elastic_harness.bench.recovery import resize
    from elastic_harness.cli import main
    from elastic_harness.commands import run
    from elastic_harness.lifecycle import kube, local, slurm

    monkeypatch.chdir(tmp_path)
    for var in ("PET_RDZV_ENDPOINT", "PET_RDZV_ID", "PET_NNODES", "PET_NPROC_PER_NODE"):
        monkeypatch.delenv(var, raising=False)
    for module, name in ((run, "launch_local"), (elastic_harness.agent.node, "run_agent"),
                         (checkpoint, "measure"), (recovery, "launch"), (resize, "run_harness_until"),
                         (local.LocalScheduler, "submit"),
                         (slurm.SlurmScheduler, "submit"), (kube.KubeScheduler, "submit")):
        monkeypatch.setattr(module, name, _must_not_start)

    def call(*args: object) -> Result:
        capsys.readouterr()
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:  # argparse's usage errors
            code = e.code
        out, err = capsys.readouterr()
        return Result(code, out, err, None)

    return call


def model_of(step_dir: Path):
    from torch.distributed.checkpoint import FileSystemReader

    from elastic_harness.checkpoint.offline import load_model_tensors

    return load_model_tensors(FileSystemReader(str(step_dir)))


def final_ckpt(run_dir: Path) -> Path:
    return sorted((run_dir / "checkpoints").glob("step-*"))[-1]


@pytest.fixture(scope="session")
def mlp_reference(tmp_path_factory) -> Result:
    """The uninterrupted MLP run at world size 2: what every faulted run must reproduce."""
    run_dir = tmp_path_factory.mktemp("mlp-ref")
    r = cli("run", str(MLP), "--set", "train.record_samples=true", run_dir=run_dir)
    assert r.code == 0, r.err
    return r


@contextlib.contextmanager
def training_in_background(run_dir: Path, *args: str):
    """An endless MLP ``run`` (no saves) in its own process group, yielded once it has taken a
    step; stopped at the end with SIGTERM (it drains and releases its locks), SIGKILL if stuck."""
    cmd = [sys.executable, "-m", "elastic_harness", "run", str(MLP), *args, "--set", "train.steps=100000",
           "--set", "checkpoint.every_steps=0", "--set", "checkpoint.save_final=false", "--run-dir", str(run_dir)]
    first = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not any(e["event"] == "step" for e in read_jsonl(run_dir / "events.jsonl")):
            assert first.poll() is None, "the first job ended early"
            assert time.monotonic() < deadline, "the first job never trained"
            time.sleep(0.2)
        yield first
    finally:
        stop_group(first, grace_s=120)


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """A test that leaves its own SIGINT/SIGTERM/SIGHUP/SIGQUIT handler in the pytest process makes Ctrl-C
    (and a CI runner's SIGTERM) stop doing anything: fail it, and put pytest's back."""
    watched = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
    before = {sig: signal.getsignal(sig) for sig in watched}
    yield
    changed = [signal.Signals(sig).name for sig in watched if signal.getsignal(sig) is not before[sig]]
    for sig in watched:
        signal.signal(sig, before[sig])
    assert not changed, f"the test left its own handler for {', '.join(changed)} in the pytest process"


@pytest.fixture(autouse=True)
def _no_timer_file_leaks(monkeypatch):
    """``agent.watchdog.start`` points the agent's process at its FIFO (the workers inherit
    it); a test that starts one in the pytest process must not hand a dead FIFO to every
    worker started by a later test (plain torchrun's workers then fail to re-arm it)."""
    from elastic_harness.agent.watchdog import TIMER_FILE_VAR

    monkeypatch.delenv(TIMER_FILE_VAR, raising=False)
