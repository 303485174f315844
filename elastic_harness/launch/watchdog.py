"""The agent side of the step watchdog: torchelastic's ``FileTimerServer``, minus suicide.

torchelastic's own file timer (``TORCHELASTIC_ENABLE_FILE_TIMER=1``) SIGKILLs the expired
worker and then *its own process*, the agent, leaving recovery to an outer scheduler. We
want the agent to survive and restart the group itself, so we run the server ourselves
with one change: it never signals the agent. Workers find the FIFO through
``TORCHELASTIC_TIMER_FILE``, which they inherit from the agent's environment.
"""

from __future__ import annotations

import os
import tempfile
import uuid

from torch.distributed.elastic.timer import FileTimerServer

TIMER_FILE_VAR = "TORCHELASTIC_TIMER_FILE"


class WorkerOnlyTimerServer(FileTimerServer):
    def _reap_worker(self, worker_pid: int, signal: int) -> bool:
        if worker_pid == os.getpid():
            return True  # the worker was reaped; the agent lives on to restart the group
        return super()._reap_worker(worker_pid, signal)


def start(run_id: str) -> WorkerOnlyTimerServer:
    path = os.path.join(tempfile.gettempdir(), f"elastic-harness-watchdog-{uuid.uuid4().hex}")
    server = WorkerOnlyTimerServer(file_path=path, run_id=run_id, max_interval=0.1, daemon=True)
    server.start()
    os.environ[TIMER_FILE_VAR] = path
    return server
