"""Bad nodes: a node that fails twice within a window is kept out.

A node fails when its peers had to go on without it while its agent lived: it was dropped
from the rendezvous (judged gone: frozen, cut off; ``rendezvous.verdict``), or the step watchdog
stopped one of its own workers that hung itself (stopped by a signal, or stuck in the
kernel: ``/proc`` state ``T`` or ``D``; not one that waited on its peers). Crashes of its
workers are not counted here: the restart budget and the crash-loop rule (``policy``)
judge those. After ``nodes.exclude_after`` such failures within ``nodes.exclude_window``
seconds the node's agent stops for good (exit 200: the infrastructure's failure), without
closing the rendezvous, so the job goes on without it (a spare takes its place where there
is one: ``spares``); an ``excluded`` event names it, and ``report`` with it.

Call order: ``Strikes(limit, window)``; ``add(why)`` from any thread; ``verdict()`` from the
agent's main thread (a message once the node is out, else None).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

OWN_HANG_STATES = ("T", "t", "D")  # a worker hung itself (not waiting on peers: "S")
# How each of those states reads in a line ("rank 1 hung (it was stopped by a signal)").
HANG_WORDS = {"T": " (it was stopped by a signal)", "t": " (it was stopped by a tracer)",
              "D": " (in uninterruptible sleep: I/O or a driver)"}


def counted(times: Sequence[float], now: float, window_s: float) -> int:
    """Pure: failures within the window ending ``now``."""
    return sum(1 for t in times if now - t <= window_s)


def out(times: Sequence[float], now: float, limit: int, window_s: float) -> bool:
    """Pure: is the node out? (``limit`` 0: never.)"""
    return limit > 0 and counted(times, now, window_s) >= limit


class Strikes:
    def __init__(self, limit: int, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit, self.window_s, self.clock = limit, window_s, clock
        self._lock = threading.Lock()
        self._times: list[float] = []
        self.reasons: list[str] = []

    def add(self, why: str) -> None:
        with self._lock:
            self._times.append(self.clock())
            self.reasons.append(why)

    def verdict(self, node: str) -> str | None:
        with self._lock:
            if not out(self._times, self.clock(), self.limit, self.window_s):
                return None
            recent = self.reasons[-self.limit:]
        return (f"node {node} kept out of the job: it failed {len(recent)} times within "
                f"nodes.exclude_window={self.window_s:g}s ({'; '.join(recent)}); its agent stops, the job "
                "goes on without it (raise nodes.exclude_after, or 0 to never exclude)")
