"""Pure: how one fault was recovered, in place or by a restart, and who kept its process.

The words (docs/in-place.md):

- **members** of a moment: the workers of the newest generation then, one per rank, from
  the ``worker`` events every rank writes when its generation forms (a survivor too: it
  joins each generation anew). A member is known by its node and its pid: simulated hosts
  have pid namespaces of their own, so a pid alone can name two processes.
- **hit**: the members the fault ended (its kind's target, ``chaos.vocabulary``: a rank, or
  every worker of a node); for a failure nobody injected, the rank whose exit or hang the
  agent reported (unknown for a node judged lost: then no survivor count).
- **survivors**: the members before the fault it did not hit.
- **kept**: members before the fault that are members of the recovering generation (the one
  whose first step ends the recovery) with the same node and pid: their process went on.
- **new**: members of the recovering generation that were not there before the fault.
- **way**: ``in place`` when the recovering generation said it was entered in place (rank
  0's ``recovery`` event, with its ``mode``: ``repoint`` or ``rerun``), else ``restart``.
- **fell back**: some survivor took the in-place path (after the fault: a ``reformed`` or
  ``recovery`` event, an agent's ``workers`` event that kept a parked worker or found one
  ``unparked``) and yet not every survivor kept its process (docs/in-place.md, "When it
  falls back").

The phases of a fault recovered in place, consecutive from the fault to the first step, each
ending at a moment the events record (survivors' ``reformed`` events: their ``phases_s``
counted back from when each was written; the last survivor's moment ends a phase):

- ``leave``: until every survivor had left its step and parked (it includes noticing the fault);
- ``park``: until every survivor had its place in the next generation (the rendezvous, the order);
- ``reform``: until every survivor had re-formed its groups (the handshake with the new workers);
- ``restore``: until rank 0's ``resume`` (a rerun's build, the restore from memory, a reshard);
- ``first_step``: until that generation's first step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from elastic_harness.chaos.vocabulary import KINDS

IN_PLACE, RESTART = "in place", "restart"
FINISH = "finish"  # the mode of a fault whose step in flight the survivors finished (no restore)
PHASES = ("leave", "park", "reform", "restore", "first_step")


@dataclass(frozen=True)
class Member:
    """One worker of a generation."""

    rank: int
    node: str
    pid: int


@dataclass(frozen=True)
class Kept:
    """A member before the fault whose process is a member after it (its rank may change)."""

    before: Member
    after: Member


@dataclass(frozen=True)
class Recovered:
    """How one fault was recovered (module doc)."""

    way: str  # IN_PLACE or RESTART
    mode: str | None  # in place: 'repoint' or 'rerun'
    survivors: tuple[Member, ...] | None  # None: which members the fault hit is unknown
    kept: tuple[Kept, ...]
    new: tuple[Member, ...]
    phases_s: dict[str, float | None] | None  # in place only (module doc)
    tried: bool  # some survivor took the in-place path

    @property
    def survivors_kept(self) -> int | None:
        """How many survivors kept their process (None when the survivors are unknown)."""
        if self.survivors is None:
            return None
        return sum(k.before in self.survivors for k in self.kept)

    @property
    def fell_back(self) -> bool:
        """The in-place path was taken, and not every survivor went on with its process."""
        if not self.tried:
            return False
        return self.way == RESTART or (self.survivors is not None and self.survivors_kept < len(self.survivors))


def members_at(events: Sequence[dict], t: float) -> tuple[Member, ...]:
    """The newest generation's members at ``t``, by rank (module doc): the latest ``worker``
    event's world size, and per rank below it the latest ``worker`` event of that size."""
    workers = [e for e in events if e.get("event") == "worker" and e["t"] <= t and "rank" in e]
    if not workers:
        return ()
    size = workers[-1].get("world_size")
    latest: dict[int, dict] = {}
    for e in workers:
        if e.get("world_size") == size:
            latest[int(e["rank"])] = e
    return tuple(Member(r, str(e.get("node", "")), int(e["pid"])) for r, e in sorted(latest.items()))


def hit(fault: dict, members: Sequence[Member]) -> tuple[Member, ...] | None:
    """The members ``fault`` ended (module doc); None when that cannot be told from it."""
    kind = KINDS.get(fault.get("kind", ""))
    target = fault.get("target")
    if kind is not None:
        if kind.target == "rank":
            return tuple(m for m in members if m.rank == target)
        if kind.target == "node":
            return tuple(m for m in members if m.node == str(target))
        return ()  # a node added: nobody is hit
    if fault.get("cause") in ("exit", "hang") and not fault.get("peer_lost") and target is not None:
        return tuple(m for m in members if m.rank == target)
    return None


def recovered(events: Sequence[dict], fault: dict, resume: dict | None, first: dict | None) -> Recovered | None:
    """How ``fault`` was recovered: ``resume`` is the recovering generation's rank 0's
    ``resume`` event and ``first`` its first ``step`` (None: not recovered, nothing to say)."""
    if resume is None or first is None:
        return None
    before, after = members_at(events, fault["t"]), members_at(events, first["t"])
    hits = hit(fault, before)
    by_place = {(m.node, m.pid): m for m in after}
    kept = tuple(Kept(m, by_place[(m.node, m.pid)]) for m in before if (m.node, m.pid) in by_place)
    was = {(m.node, m.pid) for m in before}
    window = [e for e in events if fault["t"] < e["t"] <= first["t"]]
    sign = _recovery_event(events, resume)
    tried = any(_took_the_path(e) for e in window)
    return Recovered(
        way=IN_PLACE if sign else RESTART,
        mode=FINISH if resume["event"] == "finished" else sign.get("mode") if sign else None,
        survivors=None if hits is None else tuple(m for m in before if m not in hits),
        kept=kept, new=tuple(m for m in after if (m.node, m.pid) not in was),
        phases_s=phases(window, fault, resume, first, kept) if sign else None, tried=tried)


def _took_the_path(e: dict) -> bool:
    """Does ``e`` show a survivor on the in-place path: re-formed (``reformed``), a generation
    entered in place (``recovery``), an agent that kept a parked worker (``workers`` started
    with ``kept``) or one that did not park in time (``unparked``)?"""
    if e["event"] in ("reformed", "recovery"):
        return True
    return e["event"] == "workers" and (e.get("state") == "unparked" or bool(e.get("kept")))


def _recovery_event(events: Sequence[dict], resume: dict) -> dict | None:
    """Rank 0's ``recovery`` event of the generation ``resume`` belongs to (rank 0's latest
    ``rendezvous`` before it names the generation), or None: it was not entered in place."""
    formed = [e for e in events if e.get("event") == "rendezvous" and e.get("pid") == resume.get("pid")
              and e["t"] <= resume["t"]]
    if not formed or formed[-1].get("generation") is None:
        return None
    gen = formed[-1]["generation"]
    return next((e for e in events if e.get("event") == "recovery" and e.get("generation") == gen), None)


def phases(window: Sequence[dict], fault: dict, resume: dict, first: dict,
           kept: Sequence[Kept]) -> dict[str, float | None]:
    """The in-place phases (module doc), from the kept survivors' last ``reformed`` event each;
    a phase whose end was not recorded is None and the next one spans the gap."""
    pids = {k.after.pid for k in kept}
    last: dict[int, dict] = {}
    for e in window:
        if e["event"] == "reformed" and e.get("pid") in pids:
            last[e["pid"]] = e
    marks = [_moments(e) for e in last.values()]
    ends = {"leave": max((m[0] for m in marks), default=None), "park": max((m[1] for m in marks), default=None),
            "reform": max((m[2] for m in marks), default=None), "restore": resume["t"], "first_step": first["t"]}
    out: dict[str, float | None] = {}
    since = fault["t"]
    for name in PHASES:
        end = ends[name]
        out[name] = None if end is None else round(end - since, 4)
        since = end if end is not None else since
    return out


def _moments(reformed: dict) -> tuple[float, float, float]:
    """(parked, ordered, re-formed): when one survivor parked, had its place, had re-formed."""
    p = reformed.get("phases_s") or {}
    done = float(reformed["t"])
    ordered = done - float(p.get("reform") or 0.0)
    return ordered - float(p.get("park") or 0.0), ordered, done
