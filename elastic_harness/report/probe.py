"""Pure: what the in-memory tier costs a run, from its own steps with the tier on and off.

A probe (``checkpoint.memory_probe``) turns the tier off in every second block of steps
(``memtier.cadence.probe_on``); rank 0 records each change of the snapshot interval as a
``memory`` event (``every`` 0: off) right after the step it applies from, and every step's
time as a ``step`` event. A step's ``step_s`` runs from the previous step's record to its
own, so it holds the snapshot taken after the previous step: a step is counted as "on" when
the interval in force for the previous step was non-zero, which is the last ``memory`` event
seen before its ``step`` event.

The cost is compared block by block: each block with its neighbours of the other kind, the
same processes a few seconds apart. On a noisy machine that resolves what separate runs
cannot (their pairs spread -9..+16 % on 2 cores, more than the 3 % being measured).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ProbeCost:
    cost: float  # median over neighbouring block pairs of mean(on) / mean(off) - 1
    pairs: list[float]  # each pair's cost, in order
    on_step_s: float  # mean step time over all "on" steps counted
    off_step_s: float
    steps: int  # steps counted, both kinds


def probe_cost(events: Sequence[dict], skip: int = 1) -> ProbeCost | None:
    """The tier's step-time cost in a run that probed it; None without an on and an off block.

    ``skip``: steps left out at the start of each worker generation (warm-up). Blocks are
    runs of consecutive counted steps of one kind within one generation."""
    blocks: list[tuple[int, bool, list[float]]] = []  # (pid, on, step times), in order
    gens: dict[int, dict] = {}  # pid -> {"every": interval in force, "first": first step seen}
    for e in events:
        kind = e["event"]
        if kind not in ("step", "memory"):
            continue
        g = gens.setdefault(e.get("pid", 0), {"every": 0, "first": None})
        if kind == "memory":
            g["every"] = int(e.get("every") or 0)
            continue
        if e.get("step_s") is None:
            continue
        step = int(e["step"])
        if g["first"] is None:
            g["first"] = step
        if step - g["first"] < skip:
            continue
        key = (e.get("pid", 0), g["every"] > 0)
        if blocks and blocks[-1][:2] == key:
            blocks[-1][2].append(float(e["step_s"]))
        else:
            blocks.append((*key, [float(e["step_s"])]))
    # Every two neighbouring blocks of one generation and different kinds, (on, off) and
    # (off, on) alike: a machine slowly speeding up or slowing down favours neither kind.
    pairs = [round(statistics.fmean(a if a_on else b) / statistics.fmean(b if a_on else a) - 1, 4)
             for (a_pid, a_on, a), (b_pid, b_on, b) in zip(blocks, blocks[1:], strict=False)
             if a_pid == b_pid and a_on != b_on]
    if not pairs:
        return None
    on = [x for _, is_on, xs in blocks if is_on for x in xs]
    off = [x for _, is_on, xs in blocks if not is_on for x in xs]
    return ProbeCost(cost=round(statistics.median(pairs), 4), pairs=pairs,
                     on_step_s=round(statistics.fmean(on), 6), off_step_s=round(statistics.fmean(off), 6),
                     steps=len(on) + len(off))
