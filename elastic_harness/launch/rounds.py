"""Pure: close a later round as soon as everyone expected has joined it (issue 36, item 2).

torch's dynamic rendezvous closes a round ``last_call`` after ``nodes.min`` joined it, or
at once when ``nodes.max`` did. After a node loss ``nodes.max`` is never reached, so every
survivor waited the whole last call (2 s here, 30 s in torch) once more than one agent
waited to rejoin: node loss took about 0.2 s at 2 nodes and 2.5-3.5 s at 4 to 8.

Who is expected is in the state itself, so every agent decides alike, whichever joins last:
the participants of the last completed round (``members``, written when a round completes)
less the nodes known gone (``gone``: dropped by ``launch.liveness``/``launch.verdict`` or
expired by torch, written when an agent sees it), the agents waiting for the round (torch's
wait list), and as many hot spares (torch's redundancy list) as the round has room for. When all of them are participants, the round closes now; otherwise the
last call runs as before (a node that is slow to rejoin, a preempted node whose keep-alives
have not expired yet).

Not for round 0: no round completed before it (the start of a submission has its own last
call, ``start_last_call_timeout``).

Joining all at once (``admitted``): torch lets each agent of the wait list add itself to the
new round, one compare-and-swap each, each after its next read of the state: after a node
loss at 8 nodes the survivors joined 8-20 ms apart, and at 1,000 nodes that would be 1,000
writes in a row on one key. The first agent to join an open round adds every waiting agent
with itself, in its own write: they asked for exactly that, and their keep-alives are in the
state. Each of them then finds itself a participant and waits for the round to close.
"""

from __future__ import annotations

from collections.abc import Collection


def admitted(*, participants: Collection, waiting: Collection, max_nodes: int) -> list:
    """Pure: the waiting agents to add to an open round with the one joining it now
    (``participants``, itself included), as many as the round has room for, in a fixed
    order so that every agent would choose alike."""
    room = max_nodes - len(participants) if max_nodes else len(waiting)
    candidates = sorted((n for n in waiting if n not in participants), key=repr)
    return candidates[:max(room, 0)]


def everyone_in(*, round_: int, members: Collection, gone: Collection, participants: Collection,
                waiting: Collection, spares: Collection = (), max_nodes: int = 0) -> bool:
    """Pure: has every node expected in this round joined it? (Module doc.) ``spares``:
    torch's redundancy list (hot spares, ``nodes.spares``), expected too while the round has
    room for them (``max_nodes``): one may not have seen the vacancy yet."""
    if round_ == 0 or not members:
        return False
    expected = (set(members) - set(gone)) | set(waiting)
    joined = set(participants)
    room = max_nodes - len(expected) if max_nodes else 0
    extra = min(room, len(set(spares) - joined)) if room > 0 else 0
    return expected <= joined and len(joined) >= len(expected) + extra
