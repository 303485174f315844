"""The agent side of the step watchdog: torchelastic's ``FileTimerServer``, minus suicide.

torchelastic's own file timer (``TORCHELASTIC_ENABLE_FILE_TIMER=1``) SIGKILLs the expired
worker and then *its own process*, the agent, leaving recovery to an outer scheduler. We
want the agent to survive and restart the group itself, so we run the server ourselves
with one change: it never signals the agent. Workers find the FIFO through
``TORCHELASTIC_TIMER_FILE``, which they inherit from the agent's environment.

The FIFO lives in the run dir (``launch.scratch.watchdog_fifo``), so an agent killed
outright leaves nothing in the system temp dir; its name is a random token, and the agent
holds a lock file beside it for its life (``stale_fifos``: what another agent may remove). Where the run dir cannot hold a FIFO (some
FUSE mounts), it goes to a private temp dir that ``stop()`` removes.
A worker it kills leaves no exception behind, so the server says what it did: ``on_reap``
(set by the agent once it knows its workers) hears the pid and how long since that worker
last armed its timer, and the agent records a ``hang`` failure (``agent.node``).

Two deadlines per worker (``runtime.timer``): the *progress* one (SIGKILL when
it lapses: a hang, after ``timeouts.step`` or a phase's budget) and the *stall* one, with
no signal, derived from the worker's measured steps. A lapsed stall deadline kills nobody by
itself: the server asks ``judge`` (``agent.stall``: is a peer of the group gone, by
``rendezvous.verdict``?) at each pass until the worker makes progress again, and stops the
worker when the verdict says so (``on_verdict`` reports it instead of ``on_reap``);
``on_stall`` hears each stall once, when the looking starts.

Call order: ``start()`` once, before the workers start; ``stop()`` once, after they ended.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastic_harness.launch.scratch import fifo_lock, stale_fifos, watchdog_fifo
from elastic_harness.torchcompat import probe
from elastic_harness.torchcompat.agent import TimerServerBase

TIMER_FILE_VAR = "TORCHELASTIC_TIMER_FILE"
STALL_SCOPE = "elastic-harness-stall"  # ``runtime.timer.STALL_SCOPE`` (the agent imports no worker code)


class WorkerOnlyTimerServer(TimerServerBase):
    def __init__(self, fifo: Path, run_id: str, private_dir: str | None = None, lock_fd: int | None = None) -> None:
        super().__init__(file_path=str(fifo), run_id=run_id, max_interval=0.1, daemon=True)
        self._fifo, self._private_dir, self._lock_fd = fifo, private_dir, lock_fd
        self._armed: dict[int, float] = {}  # worker pid -> when it last armed its timer
        self.on_reap: Callable[[int, float, str], None] | None = None  # (pid, seconds silent, state)
        self.judge: Callable[[float, float], Any] | None = None  # (stalled s, bound s) -> verdict
        self.on_verdict: Callable[[int, float, Any], None] | None = None  # (pid, stalled s, verdict)
        self._verdicts: dict[int, Any] = {}  # workers stopped on a verdict, until reaped
        self.on_stall: Callable[[int, float, float], None] | None = None  # (pid, stalled s, bound s)
        # In place: a worker stopped on a verdict leaves its step instead of being killed,
        # when this says it did (``HarnessAgent.leave_on_verdict``: (pid, reason) -> bool).
        self.leave: Callable[[int, str], bool] | None = None
        self._stalls: dict[int, float] = {}  # worker pid -> the progress its reported stall followed

    def get_expired_timers(self, deadline: float) -> dict[int, list]:
        lapsed = super().get_expired_timers(deadline)
        stalled = {pid: rs for pid, rs in lapsed.items() if {r.scope_id for r in rs} == {STALL_SCOPE}}
        expired = {pid: rs for pid, rs in lapsed.items() if pid not in stalled}
        if not stalled or self.judge is None:
            return expired
        pid = min(stalled, key=lambda p: self._armed.get(p, deadline))  # the most stalled worker
        armed = self._armed.get(pid, deadline)
        bound = stalled[pid][0].expiration_time - armed
        if self.on_stall is not None and self._stalls.get(pid) != armed:
            self._stalls[pid] = armed  # once per stall: the agent starts looking for evidence
            with contextlib.suppress(Exception):
                self.on_stall(pid, deadline - armed, bound)
        with contextlib.suppress(Exception):  # a question that fails must not stop the watchdog
            found = self.judge(deadline - armed, bound)
            if found:
                for p in stalled:  # with the deadline that kills (the stall one has no signal)
                    self._verdicts[p] = found
                    expired[p] = stalled[p] + [r for (q, _), r in self.timers().items() if q == p and r.signal > 0]
        return expired

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
        found = self._verdicts.pop(worker_pid, None)
        if found is not None and self.leave is not None and self._left(worker_pid, found):
            reaped = True  # its timer goes; the worker lives on and re-forms in place
        else:
            reaped = super().reap_worker(worker_pid, signal)
        armed = self._armed.pop(worker_pid, None)
        silent = time.time() - armed if armed is not None else 0.0
        with contextlib.suppress(Exception):  # a report must not stop the watchdog
            if reaped and found is not None and self.on_verdict is not None:
                self.on_verdict(worker_pid, silent, found)
            elif reaped and self.on_reap is not None:
                self.on_reap(worker_pid, silent, state)
        return reaped

    def _left(self, pid: int, found: Any) -> bool:
        with contextlib.suppress(Exception):  # a failed word means the kill goes ahead
            return bool(self.leave(pid, str(getattr(found, "reason", "a peer is gone"))))
        return False

    def stop(self) -> None:
        super().stop()  # removes the FIFO
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.remove(fifo_lock(self._fifo))
            os.close(self._lock_fd)
            self._lock_fd = None
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
    fifo = watchdog_fifo(run_dir, os.urandom(8).hex())
    lock_fd = None
    try:
        fifo.parent.mkdir(parents=True, exist_ok=True)
        lock_fd = _hold(fifo_lock(fifo))  # before the FIFO exists: never seen without it
        _remove_stale(fifo.parent)
        server = WorkerOnlyTimerServer(fifo, run_id, lock_fd=lock_fd)
    except OSError:  # no FIFOs on this file system: a private temp dir, removed by stop()
        if lock_fd is not None:
            with contextlib.suppress(OSError):
                os.remove(fifo_lock(fifo))
            os.close(lock_fd)
        private = tempfile.mkdtemp(prefix="elastic-harness-watchdog-")
        fifo = Path(private) / "watchdog.fifo"
        server = WorkerOnlyTimerServer(fifo, run_id, private_dir=private)
    server.start()
    os.environ[TIMER_FILE_VAR] = str(fifo)
    return server


def _hold(lock: Path) -> int:
    """Create ``lock`` and hold it locked (``flock``) until the descriptor is closed: by
    ``stop()``, or by the kernel when this process dies."""
    fd = os.open(lock, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd


def _held(lock: Path) -> bool:
    """Does a live process hold ``lock``? (Taking it for a moment says nobody does.)"""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return True  # gone meanwhile, or not ours to judge
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def _remove_stale(where: Path) -> None:
    """FIFOs (and their locks) of agents that were killed before they could remove their own."""
    with contextlib.suppress(OSError):
        for name in stale_fifos(os.listdir(where), lambda lock: _held(where / lock)):
            with contextlib.suppress(OSError):
                if stat.S_ISFIFO(os.lstat(where / name).st_mode):
                    os.remove(where / name)
            with contextlib.suppress(OSError):
                os.remove(fifo_lock(where / name))
