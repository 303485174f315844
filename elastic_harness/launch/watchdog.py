"""The agent side of the step watchdog: torchelastic's ``FileTimerServer``, minus suicide.

torchelastic's own file timer (``TORCHELASTIC_ENABLE_FILE_TIMER=1``) SIGKILLs the expired
worker and then *its own process*, the agent, leaving recovery to an outer scheduler. We
want the agent to survive and restart the group itself, so we run the server ourselves
with one change: it never signals the agent. Workers find the FIFO through
``TORCHELASTIC_TIMER_FILE``, which they inherit from the agent's environment.

The FIFO lives in the run dir (``launch.scratch.watchdog_fifo``), so an agent killed
outright leaves nothing in the system temp dir. Where the run dir cannot hold a FIFO (some
FUSE mounts), it goes to a private temp dir that ``stop()`` removes.
Call order: ``start()`` once, before the workers start; ``stop()`` once, after they ended.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
import tempfile
from pathlib import Path

from torch.distributed.elastic.timer import FileTimerServer

from elastic_harness.launch.scratch import stale_fifos, watchdog_fifo

TIMER_FILE_VAR = "TORCHELASTIC_TIMER_FILE"


class WorkerOnlyTimerServer(FileTimerServer):
    def __init__(self, fifo: Path, run_id: str, private_dir: str | None = None) -> None:
        super().__init__(file_path=str(fifo), run_id=run_id, max_interval=0.1, daemon=True)
        self._fifo, self._private_dir = fifo, private_dir

    def _reap_worker(self, worker_pid: int, signal: int) -> bool:
        if worker_pid == os.getpid():
            return True  # the worker was reaped; the agent lives on to restart the group
        return super()._reap_worker(worker_pid, signal)

    def stop(self) -> None:
        super().stop()  # removes the FIFO
        if self._private_dir:
            shutil.rmtree(self._private_dir, ignore_errors=True)
        else:  # RUN_DIR/tmp, unless another agent's FIFO is still in it
            with contextlib.suppress(OSError):
                os.rmdir(self._fifo.parent)


def start(run_id: str, run_dir: Path) -> WorkerOnlyTimerServer:
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
