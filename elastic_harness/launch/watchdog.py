"""The agent side of the step watchdog: torchelastic's ``FileTimerServer``, minus suicide.

torchelastic's own file timer (``TORCHELASTIC_ENABLE_FILE_TIMER=1``) SIGKILLs the expired
worker and then *its own process*, the agent, leaving recovery to an outer scheduler. We
want the agent to survive and restart the group itself, so we run the server ourselves
with one change: it never signals the agent. Workers find the FIFO through
``TORCHELASTIC_TIMER_FILE``, which they inherit from the agent's environment.

The FIFO lives in the run dir (``launch.scratch.watchdog_fifo``), so an agent killed
outright leaves nothing in the system temp dir. Where the run dir cannot hold a FIFO (some
FUSE mounts), it goes to a private temp dir that ``stop()`` removes.
A worker it kills leaves no exception behind, so the server says what it did: ``on_reap``
(set by the agent once it knows its workers) hears the pid and how long since that worker
last armed its timer, and the agent records a ``hang`` failure (``launch.agent``).

Call order: ``start()`` once, before the workers start; ``stop()`` once, after they ended.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from elastic_harness.launch.scratch import stale_fifos, watchdog_fifo
from elastic_harness.torchcompat import probe
from elastic_harness.torchcompat.agent import TimerServerBase

TIMER_FILE_VAR = "TORCHELASTIC_TIMER_FILE"


class WorkerOnlyTimerServer(TimerServerBase):
    def __init__(self, fifo: Path, run_id: str, private_dir: str | None = None) -> None:
        super().__init__(file_path=str(fifo), run_id=run_id, max_interval=0.1, daemon=True)
        self._fifo, self._private_dir = fifo, private_dir
        self._armed: dict[int, float] = {}  # worker pid -> when it last armed its timer
        self.on_reap: Callable[[int, float, str], None] | None = None  # (pid, seconds silent, state)

    def register_timers(self, timer_requests: list) -> None:
        now = time.time()
        for request in timer_requests:
            if request.expiration_time >= 0:
                self._armed[request.worker_pid] = now
        super().register_timers(timer_requests)

    def reap_worker(self, worker_pid: int, signal: int) -> bool:
        if worker_pid == os.getpid():
            return True  # the worker was reaped; the agent lives on to restart the group
        state = process_state(worker_pid)  # before the kill: was it stopped, or waiting?
        reaped = super().reap_worker(worker_pid, signal)
        armed = self._armed.pop(worker_pid, None)
        if reaped and self.on_reap is not None:
            with contextlib.suppress(Exception):  # a report must not stop the watchdog
                self.on_reap(worker_pid, time.time() - armed if armed is not None else 0.0, state)
        return reaped

    def stop(self) -> None:
        super().stop()  # removes the FIFO
        if self._private_dir:
            shutil.rmtree(self._private_dir, ignore_errors=True)
        else:  # RUN_DIR/tmp, unless another agent's FIFO is still in it
            with contextlib.suppress(OSError):
                os.rmdir(self._fifo.parent)


def process_state(pid: int) -> str:
    """The state letter of ``pid`` in /proc ('T' stopped, 'D' uninterruptible, 'S' sleeping,
    'R' running; '' unknown)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def start(run_id: str, run_dir: Path) -> WorkerOnlyTimerServer | None:
    """The started server, or None where ``watchdog-reap`` is off: torch's server would
    SIGKILL the agent itself after a worker, so the watchdog is not run at all (a hung
    worker then waits for its process group's timeout; said once by ``probe.on``)."""
    if not probe.on("watchdog-reap"):
        return None
    host = socket.gethostname()
    fifo = watchdog_fifo(run_dir, host, os.getpid())
    _remove_stale(fifo.parent, host)
    try:
        fifo.parent.mkdir(parents=True, exist_ok=True)
        server = WorkerOnlyTimerServer(fifo, run_id)
    except OSError:  # no FIFOs on this file system: a private temp dir, removed by stop()
        private = tempfile.mkdtemp(prefix="elastic-harness-watchdog-")
        fifo = Path(private) / "watchdog.fifo"
        server = WorkerOnlyTimerServer(fifo, run_id, private_dir=private)
    server.start()
    os.environ[TIMER_FILE_VAR] = str(fifo)
    return server


def _remove_stale(where: Path, host: str) -> None:
    """FIFOs of this host's agents that were killed before they could remove their own."""
    with contextlib.suppress(OSError):
        for name in stale_fifos(os.listdir(where), host, _alive):
            with contextlib.suppress(OSError):
                if stat.S_ISFIFO(os.lstat(where / name).st_mode):
                    os.remove(where / name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True
