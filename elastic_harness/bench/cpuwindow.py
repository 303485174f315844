"""How busy the machine's CPUs were during a moment of a run (a recovery), from /proc/stat
sampled every ``INTERVAL_S`` while the run goes.

Why: on a machine with few cores, N simulated nodes restart N-1 workers at once, and a
recovery at 8 nodes can take longer only because every core is busy (each worker's fork,
imports, process group and restore), which a cluster of real nodes, each with its own
cores, does not share. A busy fraction near 1 over the recovery says the time went to CPU
contention; well below 1 says it went to waiting (timeouts, polls, the protocol).

Call order: ``with Sampler() as s: ...run...``; then ``busy_fraction(s.samples, t0, t1)``
for any window inside the run (wall-clock times, as events record them).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence

# /proc/stat's first line: cpu user nice system idle iowait irq softirq steal ...
_STAT_FIELDS = {"user": (0, 1), "kernel": (2, 5, 6), "idle": (3,), "iowait": (4,), "steal": (7,)}


def parse_cpu_line(line: str, ticks_per_s: float) -> dict[str, float]:
    """Pure: seconds each kind of time took on all CPUs, from /proc/stat's ``cpu`` line.
    ``steal``: time the hypervisor ran something else on this VM's CPUs."""
    values = [int(v) for v in line.split()[1:9]]
    values += [0] * (8 - len(values))  # old kernels end before steal
    return {kind: sum(values[i] for i in at) / ticks_per_s for kind, at in _STAT_FIELDS.items()}


def machine_times() -> dict[str, float]:
    """``parse_cpu_line`` of this machine now; empty where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            line = f.readline()
    except OSError:
        return {}
    return parse_cpu_line(line, os.sysconf("SC_CLK_TCK")) if line.startswith("cpu ") else {}


INTERVAL_S = 0.01  # /proc/stat counts in 10 ms ticks: finer sampling adds nothing


class Sampler:
    """A thread that records (wall time, busy CPU s, all CPU s) every ``INTERVAL_S``."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float, float]] = []
        self._stop, self._first = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        self._first.wait(1.0)  # a window that starts now has a sample before it
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            times = machine_times()
            if not times:
                self._first.set()
                return  # no /proc/stat: nothing to say
            busy = times["user"] + times["kernel"]
            self.samples.append((time.time(), busy, busy + times["idle"] + times["iowait"] + times["steal"]))
            self._first.set()
            self._stop.wait(INTERVAL_S)


def _window(samples: Sequence[tuple[float, float, float]], t0: float, t1: float) -> tuple[float, float] | None:
    """(busy CPU s, all CPU s) between the samples just outside ``t0``..``t1``."""
    before = [s for s in samples if s[0] <= t0]
    after = [s for s in samples if s[0] >= t1]
    if not before or not after:
        return None
    (_, b0, a0), (_, b1, a1) = before[-1], after[0]
    return b1 - b0, a1 - a0


def busy_fraction(samples: Sequence[tuple[float, float, float]], t0: float, t1: float) -> float | None:
    """Pure: the fraction of all CPU time that was busy between ``t0`` and ``t1`` (the
    samples just outside the window bound it); None without samples around it."""
    got = _window(samples, t0, t1)
    return round(got[0] / got[1], 3) if got and got[1] > 0 else None


def busy_seconds(samples: Sequence[tuple[float, float, float]], t0: float, t1: float) -> float | None:
    """Pure: CPU seconds spent busy, on all CPUs together, between ``t0`` and ``t1`` (as
    ``busy_fraction``, bounded by the samples just outside; 10 ms ticks)."""
    got = _window(samples, t0, t1)
    return round(got[0], 3) if got else None
