"""The checkpoint saver's background threads, and how they share the CPU with training.

Two threads, one job each: ``write`` runs DCP's write of a save (planning collectives,
serialising, checksumming, writing and syncing files) and ``commit`` waits for that write,
settles the save (manifest, events) and purges. An asynchronous save's bytes are written
while training goes on, and on a machine whose cores training keeps busy that write used
to take its CPU share from the training threads (10-12 % step time on 2 cores, a save
every 10 steps).

So on Linux (scheduling classes are per thread there) both threads run in the ``SCHED_IDLE``
class while training runs: they get the CPU only when no normal thread wants it (training
waiting on a collective, on data, on the disk). Whenever training waits on them (the next
save, ``wait``, ``close``, a blocking save), ``foreground()`` puts them back in the normal
class for the wait, so a wait lasts no longer than it did without any of this, even on a
machine other processes keep busy.

A thread in ``SCHED_IDLE`` may only leave it with ``CAP_SYS_NICE`` or a ``RLIMIT_NICE`` of
20, so whether that works is probed once per process (``can_lift``); where it does not (an
unprivileged container) or the platform has no such class, the threads stay normal
(``choose_class``), as before: a lowered thread that training had to wait for could be
starved by other processes.

Call order: ``BackgroundThreads.here()`` (or ``(lowered)``); ``write``/``commit`` any number of times;
``foreground()`` around every wait on their results; ``shutdown()`` once.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

IDLE, NORMAL = "idle", "normal"


def choose_class(has_idle_class: bool, can_lift: bool) -> str:
    """Pure: the class background checkpoint threads run in while nobody waits on them."""
    return IDLE if has_idle_class and can_lift else NORMAL


def has_idle_class() -> bool:
    return hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE")


def set_class(tid: int, cls: str) -> bool:
    """Put thread ``tid`` (a native id) in ``cls``; False if the OS refused."""
    policy = os.SCHED_IDLE if cls == IDLE else os.SCHED_OTHER
    try:
        os.sched_setscheduler(tid, policy, os.sched_param(0))
        return True
    except OSError:  # EPERM leaving SCHED_IDLE unprivileged; ESRCH for a thread that ended
        return False


@functools.cache
def can_lift() -> bool:
    """Can a thread of this process enter ``SCHED_IDLE`` and leave it again? (probed once)"""
    if not has_idle_class():
        return False
    result: list[bool] = []

    def probe() -> None:
        tid = threading.get_native_id()
        result.append(set_class(tid, IDLE) and set_class(tid, NORMAL))

    t = threading.Thread(target=probe, name="ckpt-sched-probe")
    t.start()
    t.join()
    return bool(result and result[0])


class BackgroundThreads:
    """The ``write`` and ``commit`` threads of one saver (one worker thread each)."""

    def __init__(self, lowered: bool) -> None:
        """``lowered``: run in ``SCHED_IDLE`` while nobody waits (see ``here``)."""
        self.lowered = lowered
        self._tids: list[int] = []
        self._lock = threading.Lock()
        self._waiting = 0
        self._write = cf.ThreadPoolExecutor(1, "ckpt-write", initializer=self._started)
        self._commit = cf.ThreadPoolExecutor(1, "ckpt-commit", initializer=self._started)

    @classmethod
    def here(cls) -> BackgroundThreads:
        """Lowered where this process can lift its threads again (``choose_class``)."""
        return cls(lowered=choose_class(has_idle_class(), can_lift()) == IDLE)

    def _started(self) -> None:
        with self._lock:
            tid = threading.get_native_id()
            self._tids.append(tid)
            if self.lowered and not self._waiting:
                set_class(tid, IDLE)

    def write(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> cf.Future:
        return self._write.submit(fn, *args, **kwargs)

    def commit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> cf.Future:
        return self._commit.submit(fn, *args, **kwargs)

    def classes(self) -> dict[int, int]:
        """``{native thread id: scheduling policy}`` of the threads started so far."""
        with self._lock:
            tids = list(self._tids)
        out = {}
        for tid in tids:
            with contextlib.suppress(OSError):
                out[tid] = os.sched_getscheduler(tid)
        return out

    @contextlib.contextmanager
    def foreground(self) -> Iterator[None]:
        """Normal class for both threads while the caller waits on them (nests)."""
        self._shift(+1)
        try:
            yield
        finally:
            self._shift(-1)

    def _shift(self, by: int) -> None:
        if not self.lowered:
            return
        with self._lock:
            before, self._waiting = self._waiting, self._waiting + by
            if (before == 0) != (self._waiting == 0):  # the first waiter came or the last left
                for tid in self._tids:
                    set_class(tid, NORMAL if self._waiting else IDLE)

    def shutdown(self) -> None:
        """Stop taking work; running work is not waited for (the saver waited already)."""
        self._write.shutdown(wait=False)
        self._commit.shutdown(wait=False)
