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
"""

from __future__ import annotations

from collections.abc import Collection


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
