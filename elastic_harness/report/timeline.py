"""Pure: a run's events -> per-fault recovery rows, step points and goodput. No I/O.

The words (invocation, generation, final lineage, step span) and every goodput and badput
term are defined once, in ``elastic_harness.records.goodput``; goodput here is that ledger's over
the whole run dir, so ``report``, ``summary.json`` and the agent endpoint agree.

A fault row follows one ``fault`` event: the first sign of the agents reacting after it
(``is_reaction``), the next rendezvous completion, the next ``resume`` and the first step
of that generation; steps lost are the last step completed before the fault minus the step
resumed from (0 when the job drained and saved); and how it was recovered, in place or by a
restart, which members kept their process and the in-place phases (``report.inplace``).

Failures nobody injected (a worker killed from outside, a frozen node the watchdog ended, an
exception) get a row too (``injected`` False): one per agent account of a failed worker
group or watchdog kill (``failure`` events with ``cause`` ``exit`` or ``hang``) that no
earlier row explains, i.e. whose recovery (the next ``resume``) no injected fault or earlier
failure already leads to (several agents' accounts of one failure are one row). Its time is
the first ``failure`` event after the last step before it; ``detected`` is the agent's
account; ``kind`` says how the first rank ended (``SIGKILL``, ``hang``, ``exit 1``, ``lost
peer`` when the cause was on another node).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from elastic_harness.records.goodput import BADPUT_KINDS, RDZV_COMPLETE, Goodput
from elastic_harness.records.runstate import fold, split_invocations
from elastic_harness.report.inplace import Recovered, recovered
from elastic_harness.report.probe import ProbeCost, probe_cost

__all__ = ["BADPUT_KINDS", "FaultRow", "Goodput", "StepPoint", "Timeline", "build", "split_invocations"]
_GEN_EVENTS = frozenset({"rendezvous", "resume", "step", "checkpoint", "drain", "finish"})


@dataclass
class Generation:
    invocation: int
    pid: int
    world_size: int | None = None
    resume_t: float | None = None
    resume_step: int = 0
    steps: list[tuple[float, int]] = field(default_factory=list)  # (t, step), in order
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
    source: str | None = None  # where the state came from (``resume``): memory, peer, buddy or storage
    injected: bool = True  # a chaos fault (``fault`` event); False: a failure nobody injected
    cause: str | None = None  # not injected: the agent's account (which rank ended how)
    recovered_how: Recovered | None = None  # in place or by a restart, who kept its process (``report.inplace``)


@dataclass(frozen=True)
class StepPoint:
    t: float  # seconds since the run's first event
    step: int
    loss: float | None
    world_size: int | None
    generation: int  # index into Timeline.generations order
    in_lineage: bool


@dataclass(frozen=True)
class EvalPoint:
    """One evaluation: seconds since the run started, the step evaluated, its metrics."""

    t: float
    step: int
    metrics: dict


@dataclass(frozen=True)
class Timeline:
    t0: float
    invocations: int
    generations: int
    faults: list[FaultRow]
    goodput: Goodput
    points: list[StepPoint]
    evals: list[EvalPoint] = field(default_factory=list)
    probe: ProbeCost | None = None  # the in-memory tier's cost, when the run probed it
    excluded: list[dict] = field(default_factory=list)  # nodes kept out (``excluded`` events): node, message


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
        goodput=fold(events).goodput(),
        points=step_points(invocations, gens, t0),
        evals=eval_points(events, t0),
        probe=probe_cost(events),
        excluded=[{"node": e.get("node"), "message": e.get("message", "")} for e in events
                  if e.get("event") == "excluded"],
    )


def eval_points(events: Sequence[dict], t0: float) -> list[EvalPoint]:
    """Every ``eval`` event: when, at which step, which metrics (a redone step shows twice)."""
    return [EvalPoint(e["t"] - t0, int(e["step"]), dict(e.get("metrics") or {}))
            for e in events if e.get("event") == "eval"]


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
    return list(gens.values())


def mark_lineage(gens: Sequence[Generation]) -> None:
    """Set each generation's ``lineage_upto``: the lowest resume step of those after it."""
    upto = float("inf")
    for g in reversed([g for g in gens if g.active]):
        g.lineage_upto = upto
        upto = min(upto, g.resume_step)


def _first(events: Sequence[dict], after: float, pred) -> dict | None:
    return next((e for e in events if e["t"] > after and pred(e)), None)


def is_reaction(e: dict) -> bool:
    """An event showing the agents reacting to a fault."""
    if e["event"] == "drain" or (e["event"] == "failure" and e.get("cause") in ("hang", "node-lost")):
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
    """One row per ``fault`` event (later invocations count: a drain resumes in the next),
    and one per failure nobody injected (module doc), in time order."""
    flat = [e for inv in invocations for e in inv]
    rows = []
    for n, (i, f) in enumerate((i, e) for i, inv in enumerate(invocations) for e in inv if e["event"] == "fault"):
        rows.append(_fault_row(n, i, f, invocations[i], flat, t0))
    claimed = {_recovery_of(flat, f["t"]) for inv in invocations for f in inv if f["event"] == "fault"}
    for i, inv in enumerate(invocations):
        for e in inv:
            if e["event"] != "failure" or e.get("cause") not in ("exit", "hang", "node-lost"):
                continue
            key = _recovery_of(flat, e["t"])
            if key in claimed:
                continue  # an injected fault's, or an earlier account of the same failure
            claimed.add(key)
            rows.append(_failure_row(i, e, inv, flat, t0))
    rows.sort(key=lambda r: r.t)
    return [replace(r, index=n) for n, r in enumerate(rows)]


def _recovery_of(flat: Sequence[dict], t: float) -> tuple[float, int] | None:
    """The ``resume`` that recovers from something at time ``t`` (None: the run ended first)."""
    resume = _first(flat, t, lambda e: e["event"] == "resume")
    return (resume["t"], resume.get("pid", 0)) if resume else None


def _failure_row(i: int, account: dict, inv: Sequence[dict], flat: Sequence[dict], t0: float) -> FaultRow:
    """A failure nobody injected, from its agent's account (``cause`` exit, hang or node-lost)."""
    before = [e for e in inv if e["event"] == "step" and e["t"] <= account["t"]]
    last_step_t = before[-1]["t"] if before else float("-inf")
    first_sign = _first(flat, last_step_t, lambda e: e["event"] == "failure")
    t = min(account["t"], first_sign["t"]) if first_sign else account["t"]
    kind = ("hang" if account.get("cause") == "hang" else "node lost" if account.get("cause") == "node-lost"
            else account.get("signal")
            or ("lost peer" if account.get("peer_lost") else f"exit {account.get('exit_code', '?')}"))
    row = _fault_row(0, i, {**account, "t": t, "kind": kind, "target": account.get("rank")}, inv, flat, t0)
    step = max([account.get("step") or 0] + ([int(before[-1]["step"])] if before else []))
    lost = max(0, step - row.resumed_from) if row.resumed_from is not None else None
    return replace(row, detected=round(account["t"] - t0, 4), step=step, steps_lost=lost, injected=False,
                   cause=account.get("message"))


def _fault_row(n: int, i: int, f: dict, inv: Sequence[dict], flat: Sequence[dict], t0: float) -> FaultRow:
    detect = _first(flat, f["t"], is_reaction)
    after = detect["t"] if detect else f["t"]
    rdzv = _first(flat, after, lambda e: e["event"] == "torchelastic" and e.get("name", "").endswith(RDZV_COMPLETE))
    rdzv = rdzv or _first(flat, f["t"], lambda e: e["event"] == "rendezvous")
    # What recovered it: the next generation's ``resume``, or the survivors' ``finished`` (the
    # step in flight finished in place: nothing loaded, it goes on from the step before).
    resume = _first(flat, rdzv["t"] if rdzv else f["t"], lambda e: e["event"] in ("resume", "finished"))
    finished = resume is not None and resume["event"] == "finished"
    first = resume and _first(flat, resume["t"], lambda e: e["event"] == "step" and e.get("pid") == resume.get("pid"))
    step = _step_before(inv, f)
    resumed_from = (int(resume["step"]) - 1 if finished else int(resume.get("step") or 0)) if resume else None
    graceful = any(e["event"] == "drain" and f["t"] <= e["t"] <= (resume["t"] if resume else e["t"]) for e in flat)
    lost = max(0, step - resumed_from) if step is not None and resumed_from is not None else None
    before = [e for e in inv if e["event"] == "step" and e["t"] <= f["t"]]

    def rel(e: dict | None) -> float | None:
        return round(e["t"] - t0, 4) if e else None

    return FaultRow(
        index=n, kind=f.get("kind", "?"), target=f.get("target", 0), invocation=i, t=rel(f), step=step,
        detected=rel(detect), rendezvous=rel(rdzv), loaded=None if finished else rel(resume), first_step=rel(first or None),
        resumed_from=resumed_from, load_s=resume.get("load_s") if resume else None, steps_lost=lost,
        graceful=graceful, recovery_s=round(first["t"] - f["t"], 4) if first else None,
        world_size_before=before[-1].get("world_size") if before else None,
        world_size_after=first.get("world_size") if first else None,
        source="the step in flight" if finished else resume.get("source") if resume else None,
        recovered_how=recovered(flat, f, resume, first or None),
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
