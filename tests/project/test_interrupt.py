"""Ctrl-C stops a running pytest of this suite, and everything its tests started (issue 34).

It did not: a test waiting on ``servers.spawn_ranks`` left the ranks running, and
multiprocessing joins a process's children at its exit, so pytest waited for the ranks
however long they took (forever, for a rank waiting on a peer); a test waiting on
``conftest.cli`` left its command running past pytest's exit (the command leads a session
of its own, so the terminal's Ctrl-C never reaches it). Each case runs a test of
``interrupted_slow.py`` in a pytest of its own process group, sends that pytest SIGINT once
the slow part is under way, and requires pytest to end, everything it started to be gone
and its temp dir to be empty, within bounds.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.servers import wait_until

pytestmark = pytest.mark.timeout(300)
SLOW = Path(__file__).with_name("interrupted_slow.py")
CASES = {"ranks": "test_ranks_that_take_long", "command": "test_a_command_that_takes_long"}


def _sigint_as_in_a_terminal() -> None:
    """A shell's background job starts with SIGINT ignored, and Python keeps it so."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _stat(pid: str) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def survivors(pgid: int, token: str) -> list[int]:
    """Live processes of group ``pgid``, and any whose command line names ``token``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, IndexError):
            state, _, group = _stat(pid)[:3]
            mine = int(group) == pgid or token.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
            if mine and state != "Z" and int(pid) != os.getpid():
                found.append(int(pid))
    return found


def _started(case: str, ready: Path, token: str) -> bool:
    if case == "ranks":
        return len(list(ready.iterdir())) == 2
    return any(token.encode() in Path(f"/proc/{p}/cmdline").read_bytes()
               for p in filter(str.isdigit, os.listdir("/proc")) if _readable(p))


def _readable(pid: str) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes() != b""
    except OSError:
        return False


@pytest.mark.parametrize("case", [pytest.param("ranks", marks=pytest.mark.e2e), "command"])
def test_sigint_ends_a_running_pytest_and_what_it_started(tmp_path, case):
    token = f"eh-sigint-{uuid.uuid4().hex[:12]}"
    # The inner pytest's TMPDIR, short: multiprocessing's forkserver puts its AF_UNIX socket
    # there (107 bytes at most), and under xdist tmp_path is deeper (``popen-gwN/``).
    ready, tmp = tmp_path / "ready", Path(tempfile.mkdtemp(prefix="eh-sigint-"))
    ready.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "EH_INTERRUPT_READY": str(ready),
           "EH_INTERRUPT_TOKEN": token, "EH_INTERRUPT_HOLDER": str(os.getpid())}
    cmd = [sys.executable, "-m", "pytest", str(SLOW), "-k", CASES[case], "-p", "no:cacheprovider", "-q"]
    with open(tmp_path / "inner.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_sigint_as_in_a_terminal)
    try:
        wait_until(lambda: _started(case, ready, token) or proc.poll() is not None, 180, f"the {case} to start")
        assert proc.poll() is None, (tmp_path / "inner.log").read_text()
        os.kill(proc.pid, signal.SIGINT)
        try:
            code = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            pytest.fail(f"pytest still running 90 s after SIGINT:\n{(tmp_path / 'inner.log').read_text()[-3000:]}")
        assert code == pytest.ExitCode.INTERRUPTED, (tmp_path / "inner.log").read_text()[-3000:]
        wait_until(lambda: not survivors(proc.pid, token), 60, "what the interrupted pytest started to end")
        assert sorted(p.name for p in tmp.iterdir()) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in survivors(proc.pid, token):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def test_ctrl_c_while_the_commands_load_is_one_line_and_exit_130():
    """Ctrl-C in the first 0.3 s of `run` printed a 30-line KeyboardInterrupt traceback from
    the imports `build_parser` makes. `entry` now says "interrupted" and exits 130 then too,
    and the CLI module imports argparse only inside `entry`'s reach."""
    code = ("import importlib, sys\n"
            "from elastic_harness import cli\n"
            "assert 'argparse' not in sys.modules, 'imported before entry() can catch a Ctrl-C'\n"
            "def interrupted(name, *args):\n"
            "    raise KeyboardInterrupt\n"
            "importlib.import_module = interrupted\n"
            "sys.argv = ['elastic-harness', 'run', 'jobs/mlp.yaml']\n"
            "cli.entry()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert (r.returncode, r.stderr, r.stdout) == (130, "interrupted\n", "")
