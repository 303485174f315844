"""Pure: a run's events -> per-fault recovery rows and a goodput breakdown. No I/O.

Words used here:

- *invocation*: the events from one host ``start`` (``who=host``) to the next; a run dir
  that was stopped and re-run holds several. Time between invocations is not wall time.
- *generation*: the worker processes one rendezvous started. Rank 0 narrates it
  (``rendezvous``, ``resume``, ``step``, ``checkpoint`` events), so rank 0's pid names it.
  A generation is *active* if it resumed and completed at least one step.
- *final lineage*: the steps that led to the final model. Walking the active generations
  from the newest back, each one contributes the steps after the one it resumed from, up to
  the step its successor resumed from; the steps past that were redone, so they were lost.
- *step span*: the wall time between a ``step`` event and the previous one of the same
  generation (the first span starts at the generation's ``resume`` event). With
  ``train.log_every > 1`` a span covers several steps, shared out evenly.

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
- **restart**: from that rendezvous completion to the new generation's ``resume`` event:
  spawning workers, process group, model build and the checkpoint load.
- **checkpoint_blocking**: the ``blocking_s`` of every checkpoint, taken out of the segment
  it interrupted (the step span after the step saved, or the shutdown after the last step).
- **shutdown**: after the last step event of an invocation to its last event: final save,
  digest, agents and host exiting (or, for an invocation that failed, its failed attempts).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field

BADPUT_KINDS = ("startup", "rendezvous", "restart", "checkpoint_blocking", "lost_work", "shutdown")
_GEN_EVENTS = frozenset({"rendezvous", "resume", "step", "checkpoint", "drain", "finish"})
RDZV_COMPLETE = "_mark_rendezvous_complete"


@dataclass
class Generation:
    invocation: int
    pid: int
    world_size: int | None = None
    resume_t: float | None = None
    resume_step: int = 0
    steps: list[tuple[float, int]] = field(default_factory=list)  # (t, step), in order
    checkpoints: list[tuple[int, float]] = field(default_factory=list)  # (step, blocking_s)
    lineage_upto: float = float("inf")  # last step of this generation in the final lineage

    @property
    def active(self) -> bool:
        return self.resume_t is not None and bool(self.steps)


@dataclass(frozen=True)
class FaultRow:
    """One injected fault. Times are seconds since the run's first event; None = not seen."""

    index: int
    kind: str
    target: int
    invocation: int
    t: float
    step: int | None  # last step completed before the fault
    detected: float | None  # first sign of the agents reacting (rendezvous join, FAILED, drain)
    rendezvous: float | None  # the next rendezvous completed
    loaded: float | None  # the checkpoint was loaded (``resume`` event)
    first_step: float | None  # the first step after that finished
    resumed_from: int | None  # step of the checkpoint loaded
    load_s: float | None
    steps_lost: int | None  # step minus resumed_from (0 when it drained)
    graceful: bool  # the job drained and saved before stopping
    recovery_s: float | None  # fault to first step after it
    world_size_before: int | None
    world_size_after: int | None


@dataclass(frozen=True)
class Goodput:
    wall_s: float
    productive_s: float
    goodput: float
    badput: dict[str, float]  # BADPUT_KINDS -> seconds


@dataclass(frozen=True)
class StepPoint:
    t: float  # seconds since the run's first event
    step: int
    loss: float | None
    world_size: int | None
    generation: int  # index into Timeline.generations order
    in_lineage: bool


@dataclass(frozen=True)
class Timeline:
    t0: float
    invocations: int
    generations: int
    faults: list[FaultRow]
    goodput: Goodput
    points: list[StepPoint]


def build(events: Sequence[dict]) -> Timeline:
    """The whole analysis: events of every invocation in the run dir, in file order."""
    invocations = split_invocations(events)
    t0 = invocations[0][0]["t"] if invocations and invocations[0] else 0.0
    gens = [g for i, inv in enumerate(invocations) for g in generations(inv, i)]
    mark_lineage(gens)
    return Timeline(
        t0=t0,
        invocations=len(invocations),
        generations=len(gens),
        faults=fault_rows(invocations, t0),
        goodput=goodput(invocations, gens),
        points=step_points(invocations, gens, t0),
    )


def split_invocations(events: Sequence[dict]) -> list[list[dict]]:
    """Events cut at each host ``start``, each part sorted by time."""
    parts: list[list[dict]] = []
    for e in events:
        if not parts or (e.get("event") == "start" and e.get("who") == "host" and parts[-1]):
            parts.append([])
        parts[-1].append(e)
    return [sorted(p, key=lambda e: e["t"]) for p in parts]


def generations(inv: Sequence[dict], invocation: int) -> list[Generation]:
    """Worker generations of one invocation, in order of their first event."""
    gens: dict[int, Generation] = {}
    for e in inv:
        if e["event"] not in _GEN_EVENTS:
            continue
        pid = e.get("pid", 0)
        if e["event"] == "checkpoint" and pid not in gens and gens:
            pid = list(gens)[-1]  # written by a helper process: the latest generation's
        g = gens.setdefault(pid, Generation(invocation, pid))
        kind = e["event"]
        if kind == "rendezvous":
            g.world_size = e.get("world_size")
        elif kind == "resume":
            g.resume_t, g.resume_step = e["t"], int(e.get("step") or 0)
            g.world_size = e.get("world_size", g.world_size)
        elif kind == "step" and g.resume_t is not None:
            g.steps.append((e["t"], int(e["step"])))
            g.world_size = e.get("world_size", g.world_size)
        elif kind == "checkpoint":
            g.checkpoints.append((int(e["step"]), float(e.get("blocking_s") or 0.0)))
    return list(gens.values())


def mark_lineage(gens: Sequence[Generation]) -> None:
    """Set each generation's ``lineage_upto``: its successor's resume step (see module doc)."""
    upto = float("inf")
    for g in reversed([g for g in gens if g.active]):
        g.lineage_upto = upto
        upto = g.resume_step


def _share(a: int, b: int, g: Generation) -> float:
    """Fraction of steps (a, b] of generation g that are in the final lineage."""
    if b <= a:
        return 0.0
    kept = min(b, g.lineage_upto) - max(a, g.resume_step)
    return max(0.0, kept) / (b - a)


@dataclass
class Segment:
    start: float
    end: float
    kind: str  # "step" or one of BADPUT_KINDS except lost_work/checkpoint_blocking
    lineage: float = 0.0  # step segments: share of its steps in the final lineage
    blocked: float = 0.0  # checkpoint blocking taken out of it

    @property
    def duration(self) -> float:
        return max(0.0, self.end - self.start)


def segments(inv: Sequence[dict], gens: Sequence[Generation]) -> list[Segment]:
    """Contiguous segments covering one invocation, first event to last (see module doc)."""
    if not inv:
        return []
    t_start, t_end = inv[0]["t"], inv[-1]["t"]
    active = sorted((g for g in gens if g.active), key=lambda g: g.resume_t)
    if not active:
        return [Segment(t_start, t_end, "startup")]
    out = [Segment(t_start, active[0].resume_t, "startup")]
    for i, g in enumerate(active):
        if i:
            out += _gap(inv, active[i - 1].steps[-1][0], g.resume_t)
        prev_t, prev_step = g.resume_t, g.resume_step
        for t, step in g.steps:
            out.append(Segment(prev_t, t, "step", lineage=_share(prev_step, step, g)))
            prev_t, prev_step = t, step
    out.append(Segment(active[-1].steps[-1][0], t_end, "shutdown"))
    return out


def _gap(inv: Sequence[dict], a: float, b: float) -> list[Segment]:
    """Between two active generations: rendezvous up to its last completion, then restart."""
    inside = [e for e in inv if a < e["t"] < b]
    marks = [e["t"] for e in inside if e["event"] == "torchelastic" and e.get("name", "").endswith(RDZV_COMPLETE)]
    if not marks:
        marks = [e["t"] for e in inside if e["event"] == "rendezvous"]
    done = marks[-1] if marks else a
    return [Segment(a, done, "rendezvous"), Segment(done, b, "restart")]


def _charge_blocking(segs: list[Segment], gens: Sequence[Generation]) -> None:
    """Move each checkpoint's blocking time out of the segment it interrupted."""
    starts = [s.start for s in segs]
    for g in gens:
        if not g.active:
            continue
        times = dict((step, t) for t, step in g.steps)
        for step, blocking in g.checkpoints:
            later = [t for t, s in g.steps if s > step]
            # Logged step: the save follows its event; unlogged: inside the next span.
            at = times.get(step, later[0] - 1e-9 if later else g.steps[-1][0])
            i = max(0, bisect_right(starts, at) - 1)
            segs[i].blocked = min(segs[i].duration, segs[i].blocked + blocking)


def goodput(invocations: Sequence[Sequence[dict]], gens: Sequence[Generation]) -> Goodput:
    bad = dict.fromkeys(BADPUT_KINDS, 0.0)
    productive = wall = 0.0
    for i, inv in enumerate(invocations):
        mine = [g for g in gens if g.invocation == i]
        segs = segments(inv, mine)
        _charge_blocking(segs, mine)
        for s in segs:
            wall += s.duration
            useful = s.duration - s.blocked
            bad["checkpoint_blocking"] += s.blocked
            if s.kind == "step":
                productive += useful * s.lineage
                bad["lost_work"] += useful * (1 - s.lineage)
            else:
                bad[s.kind] += useful
    return Goodput(
        wall_s=round(wall, 4),
        productive_s=round(productive, 4),
        goodput=round(productive / wall, 4) if wall > 0 else 0.0,
        badput={k: round(v, 4) for k, v in bad.items()},
    )


def _first(events: Sequence[dict], after: float, pred) -> dict | None:
    return next((e for e in events if e["t"] > after and pred(e)), None)


def is_reaction(e: dict) -> bool:
    """An event showing the agents reacting to a fault."""
    if e["event"] == "drain":
        return True
    if e["event"] != "torchelastic":
        return False
    name, state = e.get("name", ""), e.get("state", "")
    joining = "next_rendezvous" in name and "attempts to join" in e.get("message", "")
    return joining or state == "FAILED" or name.endswith(".FAILED")


def _step_before(inv: Sequence[dict], fault: dict) -> int | None:
    """The last step completed before the fault: exact for worker-fired faults."""
    if "rank" in fault and fault.get("step") is not None:
        return int(fault["step"])
    before = [e for e in inv if e["event"] == "step" and e["t"] <= fault["t"]]
    return int(before[-1]["step"]) if before else fault.get("step")


def fault_rows(invocations: Sequence[Sequence[dict]], t0: float) -> list[FaultRow]:
    """One row per ``fault`` event; later invocations count (a drain resumes in the next)."""
    flat = [e for inv in invocations for e in inv]
    rows = []
    for n, (i, f) in enumerate((i, e) for i, inv in enumerate(invocations) for e in inv if e["event"] == "fault"):
        rows.append(_fault_row(n, i, f, invocations[i], flat, t0))
    return rows


def _fault_row(n: int, i: int, f: dict, inv: Sequence[dict], flat: Sequence[dict], t0: float) -> FaultRow:
    detect = _first(flat, f["t"], is_reaction)
    after = detect["t"] if detect else f["t"]
    rdzv = _first(flat, after, lambda e: e["event"] == "torchelastic" and e.get("name", "").endswith(RDZV_COMPLETE))
    rdzv = rdzv or _first(flat, f["t"], lambda e: e["event"] == "rendezvous")
    resume = _first(flat, rdzv["t"] if rdzv else f["t"], lambda e: e["event"] == "resume")
    first = resume and _first(flat, resume["t"], lambda e: e["event"] == "step" and e.get("pid") == resume.get("pid"))
    step = _step_before(inv, f)
    resumed_from = int(resume.get("step") or 0) if resume else None
    graceful = any(e["event"] == "drain" and f["t"] <= e["t"] <= (resume["t"] if resume else e["t"]) for e in flat)
    lost = max(0, step - resumed_from) if step is not None and resumed_from is not None else None
    before = [e for e in inv if e["event"] == "step" and e["t"] <= f["t"]]

    def rel(e: dict | None) -> float | None:
        return round(e["t"] - t0, 4) if e else None

    return FaultRow(
        index=n, kind=f.get("kind", "?"), target=f.get("target", 0), invocation=i, t=rel(f), step=step,
        detected=rel(detect), rendezvous=rel(rdzv), loaded=rel(resume), first_step=rel(first or None),
        resumed_from=resumed_from, load_s=resume.get("load_s") if resume else None, steps_lost=lost,
        graceful=graceful, recovery_s=round(first["t"] - f["t"], 4) if first else None,
        world_size_before=before[-1].get("world_size") if before else None,
        world_size_after=first.get("world_size") if first else None,
    )


def step_points(invocations: Sequence[Sequence[dict]], gens: Sequence[Generation], t0: float) -> list[StepPoint]:
    """Every step event, tagged with its generation and whether it is in the final lineage."""
    index = {(g.invocation, g.pid): n for n, g in enumerate(gens)}
    out = []
    for i, inv in enumerate(invocations):
        for e in inv:
            n = index.get((i, e.get("pid", 0)))
            if e["event"] != "step" or n is None or not gens[n].active:
                continue
            g = gens[n]
            out.append(StepPoint(
                t=round(e["t"] - t0, 4), step=int(e["step"]), loss=e.get("loss"),
                world_size=e.get("world_size"), generation=n,
                in_lineage=g.resume_step < int(e["step"]) <= g.lineage_upto,
            ))
    return out
