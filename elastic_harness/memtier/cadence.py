"""How often the in-memory tier snapshots: every ``K`` steps, with ``K`` kept within a budget.

A snapshot copies each rank's whole state (model, optimizer) into its agent's memory: about
10 ms per 50 MB on a 2-core machine, nothing for a small model, far too much for a big one to
pay after every step of a fast loop. So ``K`` is the smallest interval, at least
``checkpoint.memory_every``, at which the copy costs at most ``checkpoint.memory_budget`` of
step time (``interval``); with a budget of 0 it is exactly ``memory_every``. A crash then
redoes at most ``K - 1`` steps, against a whole durable interval without the tier.

Every rank must snapshot at the same steps (a restore needs a step that every rank holds), so
one rank measures and proposes ``K`` (``Cadence.proposal``) and the others adopt the value
that reaches them in the step's all-reduce. ``due`` then counts steps since the last
snapshot (or the step the generation started from), which is the same on every rank.

Times are the median over the last ``STEP_WINDOW`` steps and the interquartile mean over the
last ``WINDOW`` snapshots (copies alternate between two slots whose copy times can differ 2x:
a median of a few then jumps between the two modes, and the interval with it), leaving
out the first step of a generation (data loader start, compilation) and the first snapshot
into each slot (the first touch of its pages costs 3-5x a later copy): neither swings
``K``, nor does an occasional slow step.

A probe (``checkpoint.memory_probe``, blocks of ``B`` steps) turns the tier off in every second
block (``probe_on``), so that one run measures what the tier costs next to what it saves
(``report.probe_cost``): the same processes, the same minutes of a noisy machine.

Call order, per step on the proposing rank: ``proposal(step)`` when the step's all-reduce is
started; ``step_took`` with the step's whole time (hook included) less its snapshot;
``snapshot_took`` after a snapshot. Every rank: ``start(step)`` once, then per step ``agree(k)``, ``due(step, forced)`` and,
after a snapshot, ``taken(step)``.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

WINDOW = 16  # snapshots: one every K steps, so these span 16K steps
STEP_WINDOW = 64  # steps: a median of 8 wandered 5-15 ms on a 2-rank toy and flipped K every ~10 steps
MAX_INTERVAL = 100_000
HYSTERESIS = 1.25  # lowered once a quarter more than needed still leaves a step to spare
OVER = 1.1  # raised once over budget by a tenth
SKIP_STEPS = 1  # the generation's first step
SKIP_COPIES = 2  # the first snapshot into each of the two slots
MIN_COPIES = 4  # measured copies before the interval moves off memory_every (two per slot)
# Where a failing rank keeps its own last step (``MemoryTier.keep_armed``: DDP, a state that
# changes only in the optimizer's step), the periodic snapshots are the fallback for failures
# no rank survives to report: they spend this share of the budget, arming after every step
# at most the rest (else no arming, and the snapshots spend all of it, as without).
COVERED_SHARE = 1 / 3
REARM_EVERY = 16  # steps: arming that costs too much is still timed this often


def interval(copy_s: float, step_s: float, budget: float, least: int) -> int:
    """Pure: snapshot every this many steps so that ``copy_s / K <= budget * step_s``.

    ``least`` (``memory_every``) is the floor; ``budget`` 0 means exactly ``least``; with no
    measurement yet (``step_s`` 0) it is ``least``.
    """
    if budget <= 0 or step_s <= 0 or copy_s <= 0:
        return least
    return max(least, min(MAX_INTERVAL, math.ceil(copy_s / (budget * step_s) - 1e-9)))


def middle_mean(values) -> float:
    """Pure: the mean of the middle half (interquartile mean); the median below 4 values."""
    ordered = sorted(values)
    cut = len(ordered) // 4
    if cut == 0:
        return statistics.median(ordered)
    return statistics.fmean(ordered[cut:len(ordered) - cut])


def probe_on(step: int, probe: int) -> bool:
    """Pure: is the tier on for ``step`` (1-based) under a probe of ``probe``-step blocks? Blocks
    alternate on, off, on, ... from step 1; ``probe`` 0 means always on."""
    return probe <= 0 or ((step - 1) // probe) % 2 == 0


def snapshot_due(k: int, step: int, last: int, forced: bool) -> bool:
    """Pure: snapshot after ``step``? ``k`` steps after the last one (``k`` 0 = tier off), and
    whenever a durable checkpoint is taken (``forced``), so memory is never older than storage."""
    return k > 0 and (forced or step - last >= k)


class Cadence:
    def __init__(self, every: int, budget: float, probe: int = 0) -> None:
        self.every, self.probe = every, probe
        self._budget = budget  # the job's (``budget``: what the periodic snapshots spend)
        self._steps: deque[float] = deque(maxlen=STEP_WINDOW)
        self._copies: deque[float] = deque(maxlen=WINDOW)
        self._arms: deque[float] = deque(maxlen=WINDOW)
        self._covered = False  # failing ranks can keep their last step (``cover``)
        self._cheap_arm = True  # arming fits its share of the budget (``arm_took``)
        self._last = 0
        self._current: int | None = None  # this rank's proposal
        self._agreed = 0  # the interval all ranks use (``agree``)
        self._seen_steps = self._seen_copies = 0

    def step_took(self, seconds: float) -> None:
        self._seen_steps += 1
        if self._seen_steps > SKIP_STEPS:
            self._steps.append(seconds)

    def snapshot_took(self, seconds: float) -> None:
        self._seen_copies += 1
        if self._seen_copies > SKIP_COPIES:
            self._copies.append(seconds)

    def medians(self) -> tuple[float, float]:
        """(snapshot seconds, step seconds) as measured so far; 0 when not yet measured."""
        return (middle_mean(self._copies) if len(self._copies) >= MIN_COPIES else 0.0,
                statistics.median(self._steps) if self._steps else 0.0)

    def proposal(self, step: int) -> int:
        """The interval this rank's measurements call for at ``step`` (``every`` until it has
        some; 0 in a probe's off block).

        With ``need`` the unrounded interval the budget asks for, the current one is kept
        while ``need`` is at most ``OVER`` above it and not far below it (``need *
        HYSTERESIS < current - 1`` lowers it): measurements wandering around a boundary
        (2.0 then 2.1 steps) do not flip it between neighbours at every step. That holds at
        the floor too: a ``need`` wandering around 1.0 with ``every`` 1 used to drop to 1 at
        once each time it dipped (``want == every``) and rise again, ~10 flips a run."""
        copy_s, step_s = self.medians()
        want = interval(copy_s, step_s, self.budget, self.every)
        current = self._current
        if current is None or copy_s <= 0 or step_s <= 0 or self.budget <= 0:
            self._current = want
        else:
            need = copy_s / (self.budget * step_s)
            if need > current * OVER or need * HYSTERESIS < current - 1:
                self._current = want
        return self._current if probe_on(step, self.probe) else 0

    def cover(self, covered: bool) -> None:
        """Can failing ranks keep their own last step (``resume.memory_covers_failure``)?"""
        self._covered = covered

    def arm_took(self, seconds: float) -> None:
        """An arm took ``seconds``: does arming still fit the budget's share the periodic
        snapshots leave it (medians; yes until measured)?"""
        self._arms.append(seconds)
        if len(self._arms) >= MIN_COPIES and self._steps:
            limit = (1 - COVERED_SHARE) * self._budget * statistics.median(self._steps)
            self._cheap_arm = statistics.median(self._arms) <= limit

    def arming(self, step: int) -> bool:
        """Arm the tier after ``step`` (``MemoryTier.arm``)? Where failing ranks can keep
        their step, while arming fits its share of the budget (``arm_took``), and every
        ``REARM_EVERY`` steps regardless, to keep measuring it."""
        return self._covered and (self._cheap_arm or step % REARM_EVERY == 0)

    @property
    def budget(self) -> float:
        """The share of step time the periodic snapshots spend: ``COVERED_SHARE`` of the
        job's while failing ranks keep their own step (arming within budget), else all of it."""
        return self._budget * (COVERED_SHARE if self._covered and self._cheap_arm else 1.0)

    @property
    def active(self) -> bool:
        """Is the tier on at the interval last agreed (off before the first step's agreement
        and in a probe's off block)?"""
        return self._agreed > 0

    def start(self, step: int) -> None:
        """The generation starts from ``step`` (restored or 0): the next snapshot counts from it."""
        self._last = step

    def agree(self, k: int) -> bool:
        """Every rank: adopt the interval the step's all-reduce carried; True if it changed
        (the proposing rank reports it)."""
        changed, self._agreed = k != self._agreed, k
        return changed

    def due(self, step: int, forced: bool) -> bool:
        """Snapshot after ``step``, at the agreed interval?"""
        return snapshot_due(self._agreed, step, self._last, forced)

    def taken(self, step: int) -> None:
        self._last = step
