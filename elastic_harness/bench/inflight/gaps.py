"""Pure: the healthy ranks' gaps between two steps, for both sides of ``bench inflight``.

A gap is ``(seconds, step before, step after, when the step after ended)``, in one series of
consecutive steps (the harness's rank 0; each healthy torchft group). The goal's gap is the
longest one *during the node loss*: in each series, the gap the fault falls in and the one
after it (the survivors' first step at the new membership), from the last step logged before
the fault to the second one logged after it. The whole run's longest gap is reported beside
it (``anywhere``): on a busy machine it was often something else (a save waiting for the one
before it, a scheduling stall at step 5, 30 or 90).
"""

from __future__ import annotations

import statistics

LOSS_GAPS = 2  # the gap the fault falls in, and the next


def figures(series: list[list[tuple[float, int, int, float]]], fault_t: float | None) -> dict:
    """The loss's longest gap (None without a fault), the whole run's, and the median gap."""
    every = [g for gaps in series for g in gaps]
    during = [g for gaps in series for g in sorted((g for g in gaps if fault_t is not None and g[3] > fault_t),
                                                  key=lambda g: g[3])[:LOSS_GAPS]]
    loss = max(during, default=None, key=lambda g: g[0])
    anywhere = max(every, default=None, key=lambda g: g[0])
    return {"longest_gap_s": round(loss[0], 3) if loss else None,
            "longest_gap_between_steps": list(loss[1:3]) if loss else None,
            "longest_gap_anywhere_s": round(anywhere[0], 3) if anywhere else None,
            "longest_gap_anywhere_between_steps": list(anywhere[1:3]) if anywhere else None,
            "median_step_s": round(statistics.median(g[0] for g in every), 4) if every else None}
