"""Pure: what this agent does to the rendezvous state at each of torch's hook points.

The handler (``rendezvous.handler``) reads torch's state as a frozen view
(``torchcompat.rdzv.StateView``), our own fields beside it (``Ours``: sealed with it, shared
by every agent) and this agent's memory of its rounds (``Memory``: its own), asks these
functions with the evidence it has (liveness answers, the clock) and applies the actions they
return. Why each rule is as it is: docs/how-it-works.md ("Rendezvous").

Call order, per join of an agent: ``pause`` at each of torch's delays; ``join_as`` before its
add, ``admission`` after it, ``completion`` when a round completes, ``vacancy`` when a hot
spare finds a free place; ``last_call`` when a round reaches ``nodes.min``; at each read of
the state, ``expired`` before torch's expiry and ``on_sync`` after it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from elastic_harness.rendezvous import liveness, rounds

# Seconds a later round waits for a peer of the previous round that has not joined it yet
# (docs/how-it-works.md): a store round trip, well within torch's own 1 s poll.
PEER_GRACE_S = 1.0

# Seconds between a waiting agent's reads of the rendezvous state (torch's SYNC action: 1 s),
# and the oldest copy of the state torch serves instead of reading it (its state holder's
# ``cache_duration``: 1 s), which is also how late a running agent, asking every
# ``timeouts.monitor_interval``, sees a node waiting to join. At torch's 1 s a join paid
# about a second three times over: the running agent noticing the joiner, then each of the
# two agents seeing the other in the new round. One store read per agent per ``POLL_S``
# while it waits or runs.
POLL_S = 0.25

# Seconds between a running agent's reads of the state: how late it sees that a peer's group
# failed (``round_broken``: it then stops its own workers at once). Without that, the failure
# reaches a worker through its collectives, one worker's exit after another (50-150 ms a
# hop); at 0.25 s the last survivor of an 8-node group still saw it 0.17 s after the first.
# One read costs an agent well under a millisecond.
RUNNING_POLL_S = 0.1

# Store reads per second a job's running agents make together at most (each read is the whole
# state, ~260 bytes a node; at 1000 nodes and ``POLL_S`` that was 4000 reads and ~1 GB a
# second on the one store). A group of more than ``STATE_READS_PER_S * RUNNING_POLL_S`` nodes
# reads the state less often (``poll_for``): a waiting node or a broken round is seen that much later.
STATE_READS_PER_S = 200.0
SPARE_POLL_S = 0.05  # a hot spare's reads of the state while it waits
REJOIN_POLL_S = 0.05  # an agent rejoining after a restart: its peers arrive within moments

# Reads of the state a job's agents make together at most when woken by a change
# (``rendezvous.changes``): every counted write wakes every agent at once, and each then reads
# the whole state (260 KB at 1000 nodes). An agent woken within ``wake_gap`` of its last
# read reads when that gap is over: 8 ms at 8 nodes, a second at 1000.
WAKE_READS_PER_S = 1000.0


@dataclass(frozen=True)
class Ours:
    """Our fields beside torch's state, sealed with it (``sealed.pack``), read alike by every
    agent: never set on torch's object."""

    broken: int | None = None  # a round whose group failed (``on_sync``: every member stops at once)
    members: frozenset = frozenset()  # the participants of the last completed round
    gone: frozenset = frozenset()  # nodes known gone since (expired by torch, dropped by ``on_sync``)
    lives: Mapping = field(default_factory=dict)  # node -> ``liveness.identity()``, next to its keep-alive


@dataclass(frozen=True)
class Memory:
    """What one agent remembers of its rounds (its own: never shared)."""

    formed: bool = False  # a rendezvous of this agent completed: later joins are restarts
    round: int | None = None  # the round it completed last
    peers: frozenset = frozenset()  # who was in that round
    evidence: bool = False  # since then, its workers failed because a peer's connection was lost
    failed: bool = False  # its workers failed since (any cause)


@dataclass(frozen=True)
class Pace:
    """How a join of this agent waits where torch delays (``pause``)."""

    restart: bool = False  # the agent was in a group: no start-up skew
    poll: float = POLL_S  # at most this long between its reads of the state


@dataclass(frozen=True)
class Drop:
    """Drop ``node`` from the state now (as torch's expiry would): ``why`` is ``condemned``
    (``rendezvous.verdict``), ``gone`` (its agent's process is gone) or ``silent``."""

    node: Any
    why: str


@dataclass(frozen=True)
class Sync:
    """What a read of the state changes (``on_sync``): our fields, and the peers to drop."""

    ours: Ours
    drops: tuple[Drop, ...] = ()


@dataclass(frozen=True)
class Admission:
    """What an add to an open round does besides (``admission``)."""

    admit: tuple = ()  # waiting agents added with the one joining
    last_call_starts: bool = False  # the add brought the round to ``nodes.min``: its deadline is the last call
    # the round is full, or everyone expected is in: complete in this write (not at torch's
    # next pass after a deadline of now: one more write and read of the state for each agent)
    complete: bool = False


@dataclass(frozen=True)
class Completion:
    """What a round that just completed changes (``completion``)."""

    ours: Ours
    spares: tuple = ()  # waiting agents that stay hot spares


# --- polls ------------------------------------------------------------------------------------

def poll_for(nodes: int) -> float:
    """Seconds between a running agent's reads of the state in a group of ``nodes``."""
    return max(RUNNING_POLL_S, nodes / STATE_READS_PER_S)


# A view of the state older than this may predate a drop of this agent: a running agent reads
# every ``RUNNING_POLL_S``; one whose last read is older was frozen or cut off meanwhile.
STALE_VIEW_S = 10 * RUNNING_POLL_S


def judged_on_a_new_read(view_age_s: float) -> bool:
    """Pure: must "was this agent dropped?" wait for a new read of the state? Yes when the last
    read is older than ``STALE_VIEW_S``: a thawed agent heard its workers' failure before its
    first read since the freeze, and judged on the view from before it (a drop uncounted, the
    node never kept out)."""
    return view_age_s > STALE_VIEW_S


def wake_gap(nodes: int) -> float:
    """The least seconds between an agent's reads of the state that a change woke."""
    return nodes / WAKE_READS_PER_S


def rejoin_poll(nodes: int) -> float:
    """Seconds between a rejoining agent's reads of the state (a round after a failure lasts
    a fraction of a second; the same cap on a job's reads as ``poll_for``, times 4)."""
    return max(REJOIN_POLL_S, nodes / (4 * STATE_READS_PER_S))


def pause(seconds: float | tuple[float, float], pace: Pace) -> float | tuple[float, float] | None:
    """How long torch's delay of ``seconds`` waits in a join paced by ``pace``: torch's random
    start-up skew (a tuple) not at all on a restart (None), its 1 s poll at most ``pace.poll``."""
    if isinstance(seconds, tuple):
        return None if pace.restart else seconds
    return min(seconds, pace.poll)


# --- the last call ----------------------------------------------------------------------------

def last_call_s(round_: int, others_waiting: int, peers_missing: int = 0, *, start_s: float,
                later_s: float) -> float:
    """Seconds a round stays open for more agents once ``nodes.min`` have joined it.

    ``round_`` 0 is the start of a submission: ``start_s``. Later rounds: ``later_s`` while
    ``others_waiting`` agents (listed as waiting for this round, besides the one deciding)
    may still join, and at least two of their polls (``POLL_S``): a deadline one poll away
    is a coin toss between "joined" and "closed without it"; else ``PEER_GRACE_S`` (at most
    ``later_s``) while ``peers_missing`` agents of the deciding agent's previous round have
    not joined; else 0: no agent is known to be coming, so close now.
    """
    if round_ == 0:
        return start_s
    if others_waiting > 0:
        return max(later_s, 2 * POLL_S)
    return min(later_s, PEER_GRACE_S) if peers_missing > 0 else 0.0


def last_call(view: Any, ours: Ours, peers: Collection, *, start_s: float, later_s: float) -> float:
    """``last_call_s`` for the round in ``view``: the others are torch's wait and redundancy
    lists; the peers missing, this agent's ``peers`` and the last round's members not known
    gone (``rounds.still_expected``) that have not joined."""
    others = len(view.wait_list) + len(view.redundancy_list)
    missing = (set(peers) - set(view.participants)) | rounds.still_expected(
        members=ours.members, gone=ours.gone, participants=view.participants)
    return last_call_s(view.round, others, len(missing), start_s=start_s, later_s=later_s)


# --- joins ------------------------------------------------------------------------------------

def join_as(view: Any, ours: Ours, *, me: Any, max_nodes: int) -> str | None:
    """The join operation this agent's add to an open round runs instead (``rounds.join_as``),
    or None for torch's own add."""
    return rounds.join_as(node=me, participants=view.participants, max_nodes=max_nodes,
                          members=ours.members, gone=ours.gone)


def vacancy(view: Any, *, max_nodes: int) -> str:
    """The join operation a hot spare that found a free place runs (``rounds.vacancy_join``)."""
    return rounds.vacancy_join(complete=view.complete, participants=view.participants, max_nodes=max_nodes)


def admission(view: Any, ours: Ours, *, min_nodes: int, max_nodes: int) -> Admission:
    """After an add to the open round in ``view``: every waiting agent joins with it
    (``rounds.admitted``), the last call starts when that brings the round to ``nodes.min``,
    and a round so filled (``rounds.full``), or one that everyone expected has joined
    (``rounds.everyone_in``), completes in this write. Nothing for a complete round."""
    if view.complete:
        return Admission()
    admit = tuple(rounds.admitted(participants=view.participants, waiting=view.wait_list, max_nodes=max_nodes,
                                  members=ours.members, gone=ours.gone))
    participants = {**view.participants, **dict.fromkeys(admit, 0)}
    waiting = view.wait_list - set(admit)
    full = bool(admit) and rounds.full(participants, max_nodes)
    starts = bool(admit) and len(view.participants) < min_nodes <= len(participants)
    close = not full and len(participants) >= min_nodes and rounds.everyone_in(
        round_=view.round, members=ours.members, gone=ours.gone, participants=participants, waiting=waiting,
        spares=view.redundancy_list - set(admit), max_nodes=max_nodes)
    return Admission(admit=admit, last_call_starts=starts, complete=full or close)


def completion(view: Any, ours: Ours, *, max_nodes: int) -> Completion:
    """A round just completed: its participants are the members the next round expects, no
    one is known gone yet, and the agents left waiting on a full round stay hot spares
    (``rounds.stay_spares``: torch's own spares keep alive, so one without a keep-alive is none)."""
    spares = tuple(n for n in rounds.stay_spares(participants=view.participants, waiting=view.wait_list,
                                                 max_nodes=max_nodes) if n in view.last_heartbeats)
    return Completion(ours=replace(ours, members=frozenset(view.participants), gone=frozenset()), spares=spares)


# --- reads of the state -----------------------------------------------------------------------

def expired(view: Any, *, now: datetime, expiry: timedelta) -> frozenset:
    """The nodes torch's expiry is about to drop (keep-alive older than ``expiry``): known
    gone, and not peers to wait for either."""
    return frozenset(node for node, beat in view.last_heartbeats.items() if beat < now - expiry)


def on_sync(view: Any, ours: Ours, mine: Memory, *, me: Any, condemned: Collection,
            gone: Callable[[Any], bool | None], stale: datetime) -> Sync:
    """After each read of the state (torch's expiry done): this agent's round written broken
    if its group failed (``Memory.failed``/``evidence``, or peers ``condemned`` by the stall
    verdict); the ``lives`` of nodes without a keep-alive forgotten; and the peers of its last
    round that are certainly gone dropped (``liveness.dead_peers``: ``gone(identity)`` answers
    for a node's process, ``stale`` is when its silence counts)."""
    if (mine.failed or mine.evidence or condemned) and view.round == mine.round and view.complete:
        ours = replace(ours, broken=mine.round)
    lives = {n: who for n, who in ours.lives.items() if n in view.last_heartbeats}

    def verdict(node: Any) -> bool | None:
        return True if node in condemned else gone(lives.get(node))

    dead = liveness.dead_peers(view, my_round=mine.round, peers=mine.peers, me=me,
                               evidence=mine.evidence or bool(condemned), gone=verdict, stale=stale)
    drops = tuple(Drop(n, "condemned" if n in condemned else "gone" if gone(lives.get(n)) else "silent")
                  for n in sorted(dead, key=repr))
    for node in dead:
        lives.pop(node, None)
    return Sync(ours=replace(ours, lives=lives, gone=ours.gone | dead), drops=drops)


def round_broken(view: Any, ours: Ours, mine: Memory) -> bool:
    """Is this agent's last round over while its workers may still run in it (a peer wrote it
    broken, or the round moved on)? Never before a round completed."""
    return mine.round is not None and (view.round != mine.round or ours.broken == mine.round)


def shape(view: Any, ours: Ours) -> tuple:
    """What of the state other agents act on: the round, whether it is complete, closed or
    broken, whether anyone waits, the spares. Not the participants: a join or a leave
    concerns the others only through one of those."""
    return (view.round, view.complete, view.closed, ours.broken, bool(view.wait_list), len(view.redundancy_list))
