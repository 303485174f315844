"""Pure: is a silent node gone? Decided from evidence, never from silence alone.

A node that freezes or is cut off (a hung machine, a kernel panic, a NIC or switch failure)
resets no connection: its peers' collectives just wait (gloo's timeout is minutes). What the
job knows instead, and what this module weighs:

1. **its own group's stall**: each worker re-arms the step watchdog as it makes progress and
   says how long a step may take before it counts as stalled (``runtime.timer``: derived
   from the steps it measured, with a floor; longer in the phases where steps legitimately
   stop: the first steps, saves, evaluation, data loading). The agent asks this module
   only once a worker is past that bound (``stalled``);
2. **each peer's keep-alives**: the age of its last keep-alive in the rendezvous state, as of
   this agent's last read of it (never older than what was read: an agent that cannot read
   the state, cut off itself, sees nobody silent). A peer is *suspect* past
   ``silence_bound_s``: two keep-alive intervals, or twice the longest gap between its
   keep-alives seen lately (a busy agent's run late, and so does its bound), never beyond
   torch's own expiry (where torch drops it anyway);
3. **its beacon** (``rendezvous.probe``), asked only for suspects: an answer means alive (it is
   kept, however late its keep-alives), a refused connection means its process is gone, no
   answer corroborates the silence.

The verdict, for the peers of this agent's last completed round:

- ``gone``: a suspect whose beacon did not answer, or a peer whose beacon was refused,
  while this agent's group is stalled. The agent stops its workers (the group restarts) and
  drops those nodes from the rendezvous without waiting for torch's expiry;
- ``broken``: a peer is no longer listed in that round (torch's expiry dropped it, or it
  left) while this group is stalled: the group cannot finish its step, so it restarts, and
  nobody needs dropping;
- nothing otherwise: a stalled group whose peers keep alive (a slow peer, a long step)
  waits, up to the hard bound ``timeouts.step``.

Call order: ``KeepAliveGaps.observe`` at every read of the state; ``suspects`` then
``judge`` when a worker is stalled.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

GONE, ALIVE, SILENT = "gone", "alive", "silent"  # a beacon's answers (``rendezvous.probe``)
GAPS_KEPT = 20  # keep-alive gaps remembered per node (about 20 s at the default interval)


def silence_bound_s(interval_s: float, usual_gap_s: float, expiry_s: float) -> float:
    """Pure: keep-alive silence after which a peer is suspect (module doc, 2)."""
    return min(expiry_s, max(2.0 * interval_s, 2.0 * usual_gap_s))


@dataclass
class KeepAliveGaps:
    """The gaps between each node's successive keep-alives, as seen at each read of the state."""

    last: dict[Any, datetime] = field(default_factory=dict)
    gaps: dict[Any, list[float]] = field(default_factory=dict)

    def observe(self, heartbeats: Mapping[Any, datetime]) -> None:
        for node, beat in heartbeats.items():
            before = self.last.get(node)
            if before is not None and beat > before:
                kept = self.gaps.setdefault(node, [])
                kept.append((beat - before).total_seconds())
                del kept[:-GAPS_KEPT]
            self.last[node] = beat
        for node in [n for n in self.last if n not in heartbeats]:
            del self.last[node]
            self.gaps.pop(node, None)

    def usual(self, node: Any) -> float:
        """The longest gap seen lately (0 when none was seen yet)."""
        return max(self.gaps.get(node, ()), default=0.0)


@dataclass(frozen=True)
class Peer:
    """One peer of this agent's last completed round, as the state read last says."""

    node: Any
    listed: bool  # still a participant of that round
    silent_s: float | None  # age of its last keep-alive at that read (None: no keep-alive listed)
    bound_s: float  # ``silence_bound_s`` for it


@dataclass(frozen=True)
class Verdict:
    gone: frozenset = frozenset()  # drop these nodes and restart the group
    broken: bool = False  # restart the group (a peer left the round)
    reason: str = ""

    def __bool__(self) -> bool:
        return bool(self.gone) or self.broken


def suspects(peers: Collection[Peer]) -> list[Any]:
    """Pure: the listed peers silent past their bound: the ones whose beacons to ask."""
    return [p.node for p in peers if p.listed and p.silent_s is not None and p.silent_s > p.bound_s]


def judge(*, stalled_s: float, stall_bound_s: float, peers: Collection[Peer],
          answers: Mapping[Any, str]) -> Verdict:
    """Pure: the verdict on this agent's peers (module doc). ``stalled_s``: how long its most
    stalled worker has made no progress; ``stall_bound_s``: the bound that worker gave;
    ``answers``: beacons' answers (``GONE``/``ALIVE``/``SILENT``) for the nodes asked."""
    if stalled_s < stall_bound_s or not peers:
        return Verdict()
    gone, why = set(), []
    for p in peers:
        answer = answers.get(p.node, "")
        if not p.listed:
            continue
        if answer == GONE:
            gone.add(p.node)
            why.append(f"{p.node}: its host refused its agent's beacon (process gone)")
        elif answer == SILENT and p.silent_s is not None and p.silent_s > p.bound_s:
            gone.add(p.node)
            why.append(f"{p.node}: no keep-alive for {p.silent_s:.1f}s (bound {p.bound_s:.1f}s) and its "
                       "agent's beacon did not answer")
    stall = f"this node's workers made no progress for {stalled_s:.1f}s (bound {stall_bound_s:.1f}s)"
    if gone:
        return Verdict(frozenset(gone), True, f"{'; '.join(why)}; {stall}")
    left = [p.node for p in peers if not p.listed]
    if left:
        return Verdict(frozenset(), True, f"{', '.join(map(str, left))} left the round (expired or restarting); "
                                          f"{stall}")
    return Verdict()
