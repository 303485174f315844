"""Pure: goodput and badput of a run, folded one event at a time. The one definition.

Words used here (and by ``report.timeline``):

- *invocation*: the events from one host ``start`` (``who=host``) to the next; a run dir
  that was stopped and re-run holds several. Time between invocations is not wall time.
- *generation*: the worker processes one rendezvous started. Rank 0 narrates it
  (``rendezvous``, ``resume``, ``step``, ``checkpoint`` events), so rank 0's pid names it.
  A generation is *active* once it resumed and completed at least one step.
- *final lineage*: the steps that led to the newest state. When a generation becomes
  active after resuming from step R, every earlier step past R is redone, so lost.
- *step span*: the wall time between a ``step`` event and the previous one of the same
  generation (the first span starts at the generation's ``resume`` event). With
  ``train.log_every > 1`` a span covers several steps; a cut inside it keeps the share of
  its steps below the cut.

Each invocation's wall time (its first event to its last) is cut into contiguous segments,
so productive time plus every badput below adds up to the wall time exactly:

- **productive**: step spans, less checkpoint blocking, for steps in the final lineage.
- **lost_work**: step spans, less checkpoint blocking, for steps that were redone later.
- **startup**: invocation start to its first active generation's ``resume`` event: agents
  starting, the first rendezvous, spawning workers, ``import torch``, process group, model
  build and the initial checkpoint load.
- **rendezvous**: between two active generations, from the last step event of the old one
  to the last rendezvous completion before the new one resumed (torchelastic's
  ``_mark_rendezvous_complete``; without bridged events, the workers' ``rendezvous`` event).
  It includes failure detection, failed restart attempts and the rendezvous round itself.
- **hang_detection**: when the step watchdog killed a hung worker (a ``failure`` event with
  ``cause: hang``) between two active generations, the time from the old one's last step
  event to that kill: the watchdog's ``timeouts.step`` running out. The rendezvous term
  then starts at the kill.
- **restart**: from that rendezvous completion to the new generation's ``resume`` event:
  spawning workers, process group, model build and the checkpoint load.
- **checkpoint_blocking**: the ``blocking_s`` of every checkpoint (the save's call: its copy,
  or its whole write when synchronous, and any wait for the save before it), taken out of the
  segment it interrupted (the step span after the step saved, or whatever follows a
  generation's last step), never more than that segment's length.
- **shutdown**: after the last step event of an invocation to its last event: final save,
  digest, agents and host exiting (or, for an invocation that failed, its failed attempts).
  While a run is live this tail is whatever is in progress (a step, a restart).

Call order: ``update(e)`` for each event in order (the report sorts each invocation by
time; a live reader passes file order, which can differ by milliseconds), ``goodput(now)``
at any point. Memory grows with the number of step events (one small record each), since
a later resume from an old checkpoint can turn any earlier step into lost work.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BADPUT_KINDS = ("startup", "rendezvous", "restart", "checkpoint_blocking", "lost_work", "shutdown",
                "hang_detection")
RDZV_COMPLETE = "_mark_rendezvous_complete"


@dataclass(frozen=True)
class Goodput:
    wall_s: float
    productive_s: float
    goodput: float
    badput: dict[str, float]  # BADPUT_KINDS -> seconds


class _Span:
    """Steps (a, b] of one generation, ``duration`` seconds; ``upto`` is its lineage cut."""

    __slots__ = ("a", "b", "duration", "blocked", "upto")

    def __init__(self, a: int, b: int, duration: float, blocked: float) -> None:
        self.a, self.b, self.duration, self.blocked, self.upto = a, b, duration, blocked, b

    @property
    def share(self) -> float:
        return max(0, min(self.b, self.upto) - self.a) / (self.b - self.a) if self.b > self.a else 0.0

    @property
    def useful(self) -> float:
        return self.duration - self.blocked


@dataclass
class _Gen:
    resume_t: float | None = None
    resume_step: int = 0
    last_t: float = 0.0  # of its last step event (its resume while it has none)
    last_step: int = 0
    active: bool = False
    pending: float = 0.0  # blocking owed by the segment after its last step
    spans: list[_Span] = field(default_factory=list)


class GoodputLedger:
    """Incremental goodput (module doc). ``update`` is O(1) amortised per event."""

    def __init__(self) -> None:
        self._bad = dict.fromkeys(BADPUT_KINDS, 0.0)
        self._productive = 0.0
        self._wall_closed = 0.0
        self._stack: list[_Span] = []  # spans with a lineage share > 0, ordered by step
        self._new_invocation(None)

    def _new_invocation(self, t: float | None) -> None:
        self._start = self._last = t
        self._gens: dict[int, _Gen] = {}
        self._active: _Gen | None = None
        self._marks: list[tuple[float, bool]] = []  # (t, torchelastic's) since the last step
        self._hangs: list[float] = []  # watchdog kills (hang failures) since the last step

    def update(self, e: dict) -> None:
        kind, t = e.get("event"), float(e.get("t", 0.0))
        if kind == "start" and e.get("who") == "host" and self._start is not None:
            self._close_invocation()
            self._new_invocation(t)
        if self._start is None:
            self._start = t
        self._last = t if self._last is None else max(self._last, t)
        if kind == "rendezvous":
            self._marks.append((t, False))
        elif kind == "torchelastic" and str(e.get("name", "")).endswith(RDZV_COMPLETE):
            self._marks.append((t, True))
        elif kind == "failure" and e.get("cause") in ("hang", "node-lost"):
            self._hangs.append(t)
        elif kind == "resume":
            g = self._gens.setdefault(e.get("pid", 0), _Gen())
            g.resume_t, g.resume_step = t, int(e.get("step") or 0)
        elif kind == "step":
            g = self._gens.get(e.get("pid", 0))
            if g is not None and g.resume_t is not None:
                self._step(g, t, int(e["step"]))
        elif kind == "checkpoint":
            g = self._gens.get(e.get("pid", 0)) or (list(self._gens.values())[-1] if self._gens else None)
            if g is not None:  # no generation: written by a helper before any; nothing to charge
                self._charge(g, int(e["step"]), float(e.get("blocking_s") or 0.0))

    def _step(self, g: _Gen, t: float, step: int) -> None:
        if not g.active:
            self._activate(g)  # (writers' clocks may disagree a little: gaps are clipped at 0)
        if g is not self._active:
            return  # a step of an older generation after a newer one took over: ignored
        span = _Span(g.last_step, step, max(0.0, t - g.last_t), 0.0)
        span.blocked = min(span.duration, g.pending)
        g.pending = 0.0
        self._productive += span.useful * span.share
        self._bad["lost_work"] += span.useful * (1 - span.share)
        self._bad["checkpoint_blocking"] += span.blocked
        self._stack.append(span)
        g.spans.append(span)
        g.last_t, g.last_step = t, step
        self._marks.clear()
        self._hangs.clear()

    def _activate(self, g: _Gen) -> None:
        prev = self._active
        if prev is None:
            self._bad["startup"] += max(0.0, g.resume_t - self._start)
        else:
            self._gap(prev, g.resume_t)
        self._cut(g.resume_step)
        g.active, g.last_t, g.last_step = True, g.resume_t, g.resume_step
        self._active = g

    def _gap(self, prev: _Gen, resumed: float) -> None:
        """Between two active generations: hang detection up to a watchdog kill, rendezvous up
        to its last completion, then restart."""
        kills = [t for t in self._hangs if prev.last_t < t < resumed]
        hung = min(kills[0], resumed) - prev.last_t if kills else 0.0
        inside = [(t, te) for t, te in self._marks if prev.last_t < t < resumed]
        marks = [t for t, te in inside if te] or [t for t, _ in inside]
        done = max(marks[-1] if marks else prev.last_t, prev.last_t + hung)
        rdzv, restart = done - prev.last_t - hung, max(0.0, resumed - done)
        # The owed blocking interrupts the segment that starts at the last step (bisect order).
        if hung > 0:
            blocked = min(hung, prev.pending)
            hung -= blocked
        elif rdzv > 0:
            blocked = min(rdzv, prev.pending)
            rdzv -= blocked
        else:
            blocked = min(restart, prev.pending)
            restart -= blocked
        prev.pending = 0.0
        self._bad["hang_detection"] += hung
        self._bad["rendezvous"] += rdzv
        self._bad["restart"] += restart
        self._bad["checkpoint_blocking"] += blocked

    def _cut(self, resumed_from: int) -> None:
        """Every step past ``resumed_from`` is redone from now on: move it to lost work."""
        while self._stack and min(self._stack[-1].b, self._stack[-1].upto) > resumed_from:
            span = self._stack[-1]
            before = span.share
            span.upto = resumed_from
            moved = span.useful * (before - span.share)
            self._productive -= moved
            self._bad["lost_work"] += moved
            if span.share > 0:
                break  # the stack is ordered by step: everything below ends at or before the cut
            self._stack.pop()

    def _charge(self, g: _Gen, step: int, blocking: float) -> None:
        """A save after ``step`` blocked training: take it out of the span it interrupted."""
        if not g.spans or step >= g.spans[-1].b:
            g.pending += blocking  # at or after the last step so far: the next segment owes it
            return
        # Spans are contiguous: the newest one starting at or before the step holds it.
        span = next((s for s in reversed(g.spans) if s.a <= step), g.spans[0])
        before = span.blocked
        span.blocked = min(span.duration, span.blocked + blocking)
        delta = span.blocked - before
        self._productive -= delta * span.share
        self._bad["lost_work"] -= delta * (1 - span.share)
        self._bad["checkpoint_blocking"] += delta

    def _tail(self, end: float) -> dict[str, float]:
        """The open segment of the current invocation, up to ``end`` (module doc)."""
        g = self._active
        if g is None:
            return {"startup": max(0.0, end - self._start)}
        tail = max(0.0, end - g.last_t)
        blocked = min(tail, g.pending)
        return {"shutdown": tail - blocked, "checkpoint_blocking": blocked}

    def _close_invocation(self) -> None:
        for k, v in self._tail(self._last).items():
            self._bad[k] += v
        self._wall_closed += self._last - self._start

    def goodput(self, now: float | None = None) -> Goodput:
        """Totals so far; the current invocation runs to its last event, or to ``now`` if later."""
        bad = dict(self._bad)
        wall = self._wall_closed
        if self._start is not None:
            end = max(self._last, now if now is not None else self._last)
            for k, v in self._tail(end).items():
                bad[k] += v
            wall += end - self._start
        productive = self._productive
        return Goodput(
            wall_s=round(wall, 4),
            productive_s=round(productive, 4),
            goodput=round(productive / wall, 4) if wall > 0 else 0.0,
            badput={k: round(v, 4) for k, v in bad.items()},
        )
