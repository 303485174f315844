"""Waiting on checkpoint I/O by progress, not by a fixed budget.

A save, verification or load of a big state may take longer than any fixed timeout, and a
healthy one keeps moving bytes. So instead of budgets the manager (1) tells its caller that
I/O is progressing (``Ticker``, throttled, always on the thread that called the manager:
the training loop re-arms its step watchdog from it) and (2) declares a write stalled only
after ``stall_s`` seconds in which this rank's writer moved no byte (``await_write``), then
*stops* it and waits until no stream is open before anyone may touch its directory.

Progress counts this rank's bytes and, every few seconds, the bytes in the step directory
(other ranks' writes into shared storage), so a rank that finished early and waits for a
slower peer still sees the save moving.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import time
from collections.abc import Callable
from typing import Any

from elastic_harness.checkpoint.streams import WriteWatch

POLL_S = 0.05
# A background wait (an async save's commit thread) looks at progress this rarely: every
# wake-up of a Python thread during training takes the GIL from the training thread (an
# effect below this machine's noise in trials, but 20 wake-ups a second buy nothing: the
# watchdog ticks once a second, stalls are judged over minutes). The wait itself still ends
# as soon as the write does.
BACKGROUND_POLL_S = 1.0
DIR_POLL_S = 5.0


class WriterStuck(RuntimeError):
    """An abandoned write could not be stopped: its directory must not be touched.

    Not a ``HarnessError``: nothing for the user to fix here, the worker exits and
    torchelastic restarts the group (the directory is cleaned up after the next commit).
    """


class Ticker:
    """Calls ``callback()`` at most every ``interval_s`` seconds when ``tick()`` is called."""

    def __init__(self, callback: Callable[[], None] | None, interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._callback, self._interval, self._clock = callback, interval_s, clock
        self._last = float("-inf")

    def tick(self, _bytes: int = 0) -> None:
        if self._callback is None:
            return
        now = self._clock()
        if now - self._last >= self._interval:
            self._last = now
            self._callback()


class Progress:
    """Bytes this rank moved plus (polled now and then) bytes in the step directory."""

    def __init__(self, watch: WriteWatch | None, dir_bytes: Callable[[], int] | None,
                 clock: Callable[[], float]) -> None:
        self._watch, self._dir_bytes, self._clock = watch, dir_bytes, clock
        self._seen = (-1, -1)
        self._dir, self._dir_polled = -1, float("-inf")

    def moved(self) -> bool:
        """Did anything move since the last call?"""
        now = self._clock()
        if self._dir_bytes is not None and now - self._dir_polled >= DIR_POLL_S:
            self._dir_polled = now
            with contextlib.suppress(OSError):  # not created yet, or storage hiccup
                self._dir = self._dir_bytes()
        seen = (self._watch.counter.bytes if self._watch else 0, self._dir)
        moved, self._seen = seen != self._seen, seen
        return moved


def await_write(fut: Any, watch: WriteWatch | None, *, stall_s: float, tick: Callable[[], None],
                dir_bytes: Callable[[], int] | None = None,
                clock: Callable[[], float] = time.monotonic, poll_s: float = POLL_S) -> BaseException | None:
    """Wait for DCP's write ``fut``; the exception it ended with, or None.

    While this rank's writer is writing (between its first file and the end of its
    ``write_data``) and moves no byte for ``stall_s``, the write is stopped, and once no
    stream of it is open any more this returns a ``TimeoutError``; if it cannot be stopped
    within another ``stall_s`` (a write stuck in the kernel), raises ``WriterStuck``.
    Progress is looked at every ``poll_s`` (``BACKGROUND_POLL_S`` while training runs).
    """
    progress = Progress(watch, dir_bytes, clock)
    idle_since = clock()
    while not _done(fut, poll_s):
        now = clock()
        if progress.moved():
            idle_since = now
            tick()
        writing = watch is not None and watch.started and not watch.done
        if not writing:
            idle_since = now
        elif now - idle_since > stall_s:
            _stop(fut, watch, stall_s, clock)
            cf.wait([fut])  # DCP's own collectives end it, bounded by the group's timeout
            return TimeoutError(f"checkpoint write made no progress for {stall_s:.0f} s; stopped it")
    if progress.moved():  # bytes moved since the last look (a short write ends before one)
        tick()
    return fut.exception()


def _done(fut: Any, poll_s: float = POLL_S) -> bool:
    done, _ = cf.wait([fut], timeout=poll_s)
    return bool(done)


def _stop(fut: Any, watch: WriteWatch, stall_s: float, clock: Callable[[], float]) -> None:
    """Stop the writer; return once none of its streams is open, or raise ``WriterStuck``."""
    watch.stop()
    deadline = clock() + stall_s
    while not watch.quiet and not _done(fut):
        if clock() > deadline:
            raise WriterStuck(f"a checkpoint write made no progress for {stall_s:.0f} s and could not be "
                              "stopped; its directory is left in place")


def on_callers_device(fn: Callable) -> Callable:
    """``fn``, to run in another thread with the calling thread's CUDA device: a new thread
    starts on device 0, and DCP's device-to-host copies synchronise the current device's
    stream. Unchanged when CUDA is not in use."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return fn
    device = torch.cuda.current_device()

    def run(*args: Any, **kwargs: Any) -> Any:
        torch.cuda.set_device(device)
        return fn(*args, **kwargs)

    return run


def without_zip_crc(fn: Callable) -> Callable:
    """``fn`` with ``torch.save``'s per-record zip CRC32 off in the thread that runs it.

    torch 2.13 keeps that setting per thread (its config overrides are thread-local): set in
    the thread that created the saver, it did not reach the write thread, which computed
    the CRC of every byte (about 5 ms per 10 MB here). The manifest's checksums replace it.
    """

    def run(*args: Any, **kwargs: Any) -> Any:
        import torch

        torch.serialization.set_crc32_options(False)
        return fn(*args, **kwargs)

    return run
