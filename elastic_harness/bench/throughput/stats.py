"""Pure arithmetic over a throughput run's records, shared by the map-style and streaming rows
(``throughput`` and ``throughput.stream``; its own module so neither imports the other's)."""

from __future__ import annotations

import statistics


def steady_rate(stamps: list[float], warmup: int, global_batch: int) -> float:
    """Samples/s over the steps after ``warmup``: ``stamps[i]`` is the start of step ``i``."""
    window = stamps[warmup:]
    if len(window) < 2 or window[-1] <= window[0]:
        raise ValueError(f"need 2 increasing stamps after {warmup} warm-up steps, got {len(window)}")
    return global_batch * (len(window) - 1) / (window[-1] - window[0])


def cpu_per_step_ms(cpu: list[float], warmup: int) -> float | None:
    """Rank 0's process CPU milliseconds per step after ``warmup`` (``cpu[i]``: at step i's start)."""
    window = cpu[warmup:]
    return round(1e3 * (window[-1] - window[0]) / (len(window) - 1), 3) if len(window) > 1 else None


def spread(values: list[float | None]) -> dict:
    """Pure: median, quartiles, extremes and count of the values that exist."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return {"median": None, "p25": None, "p75": None, "min": None, "max": None, "n": 0}
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return {"median": round(statistics.median(xs), 4), "p25": round(q[0], 4), "p75": round(q[2], 4),
            "min": round(xs[0], 4), "max": round(xs[-1], 4), "n": len(xs)}


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None
