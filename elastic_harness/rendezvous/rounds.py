"""Pure: close a later round as soon as everyone expected has joined it.

torch's dynamic rendezvous closes a round ``last_call`` after ``nodes.min`` joined it, or
at once when ``nodes.max`` did. After a node loss ``nodes.max`` is never reached, so every
survivor waited the whole last call (2 s here, 30 s in torch) once more than one agent
waited to rejoin: node loss took about 0.2 s at 2 nodes and 2.5-3.5 s at 4 to 8.

Who is expected is in the state itself, so every agent decides alike, whichever joins last:
the participants of the last completed round (``members``, written when a round completes)
less the nodes known gone (``gone``: dropped by ``rendezvous.liveness``/``rendezvous.verdict`` or
expired by torch, written when an agent sees it), the agents waiting for the round (torch's
wait list), and as many hot spares (torch's redundancy list) as the round has room for. When
all of them are participants, the round completes in the write that made them so
(``rules.admission``); otherwise the last call runs as before (a node that is slow to rejoin,
a preempted node whose keep-alives have not expired yet).

Not for round 0: no round completed before it (the start of a submission has its own last
call, ``start_last_call_timeout``).

Joining all at once (``admitted``): torch lets each agent of the wait list add itself to the
new round, one compare-and-swap each, each after its next read of the state: after a node
loss at 8 nodes the survivors joined 8-20 ms apart, and at 1,000 nodes that would be 1,000
writes in a row on one key. The first agent to join an open round adds every waiting agent
with itself, in its own write: they asked for exactly that, and their keep-alives are in the
state. Each of them then finds itself a participant and waits for the round to close.

Never more than ``nodes.max``: with hot spares, a worker crash puts the spares on
the wait list (the round had room for a moment) next to the restarting members. The places of
the members not known gone are theirs (``room_for_others``: whoever joins first admits them,
never a spare in their place: ``admitted``, ``join_as``); a round so filled is complete in the same
write (``full``), the agents left waiting stay spares (``stay_spares``); and a later join of
a full round waits as a spare (``join_as``). Before,
the round stayed open at ``nodes.max``, a spare's own join made it ``nodes.max + 1``, and no
rule of torch's completes such a round: no worker started, and the job ended at the join
timeout with a false "rendezvous is closed".

A hot spare is never out of sight (``vacancy_join``, ``still_expected``): a spare that a
node loss left room for took the lost node's place only if it won a race. torch takes a
spare off the redundancy list, with its keep-alive, in one write and joins it in the next;
a survivor that opened the next round between those two writes saw nobody coming (no
spare listed, its lost peer known gone) and closed it alone, and the spare joined the round
after: world sizes 2, 1, 2 instead of 2, 2, and a reshard each way. Now the spare leaves
the redundancy list in the write that lists it elsewhere. And a spare (or a new node) that
opens the round itself was in no round with the survivors, so it did not wait for them: it
now waits for the last round's members not known gone, read from the state as everyone
reads them.
"""

from __future__ import annotations

from collections.abc import Collection


def admitted(*, participants: Collection, waiting: Collection, max_nodes: int,
             members: Collection = (), gone: Collection = ()) -> list:
    """Pure: the waiting agents to add to an open round with the one joining it now
    (``participants``, itself included), as many as the round has room for, in a fixed
    order so that every agent would choose alike: the ``members`` of the last round not
    ``gone`` first (their ranks restore from their own memory), then others (hot spares, new
    nodes) into the places no such member is still to take (``room_for_others``)."""
    coming = [n for n in waiting if n not in participants]
    if not max_nodes:
        return sorted(coming, key=repr)
    back = sorted((n for n in coming if _expected(n, members, gone)), key=repr)[:max(max_nodes - len(participants), 0)]
    room = room_for_others(participants=[*participants, *back], members=members, gone=gone, max_nodes=max_nodes)
    others = sorted((n for n in coming if n not in back), key=repr)
    return back + others[:max(room, 0)]


def room_for_others(*, participants: Collection, members: Collection, gone: Collection, max_nodes: int) -> int:
    """Pure: the places in an open round left to nodes that were not in the last round (hot
    spares, new nodes) once every member of it not known ``gone`` has its place, joined or
    not: after a worker crash every member restarts and rejoins within moments, and a
    spare that took one's place first would leave that member waiting as a spare (and
    its rank restoring from a peer instead of its own memory)."""
    missing = [n for n in members if n not in gone and n not in participants]
    return max_nodes - len(participants) - len(missing)


def full(participants: Collection, max_nodes: int) -> bool:
    """Pure: does an open round hold ``nodes.max`` participants? Then it is complete now, in
    the write that filled it (torch completes a round only when one node's own join makes
    it exactly ``nodes.max``: one filled by ``admitted`` stayed open, and another waiting
    agent's join made it ``nodes.max + 1``, which no rule of torch's ever completes)."""
    return bool(max_nodes) and len(participants) >= max_nodes


def stay_spares(*, participants: Collection, waiting: Collection, max_nodes: int) -> list:
    """Pure: the waiting agents a round that just completed full leaves to wait as spares
    (torch's redundancy list), in order. Left on the wait list, they would read to every
    running agent as nodes waiting to join, and each would restart its group to admit them,
    again after every round (torch moves a waiting node to the redundancy list only when
    it first finds the round full)."""
    return sorted(waiting, key=repr) if full(participants, max_nodes) else []


def join_as(*, node: object, participants: Collection, max_nodes: int, members: Collection = (),
            gone: Collection = ()) -> str | None:
    """Pure: what a node's join of an open round does instead of adding it as a
    participant (torch's join adds whoever asks): with no place left for it (the round
    full, or every free place kept for a member of the last round: ``room_for_others``), it
    waits as a spare (``add_to_redundancy_list``); None: it joins. A round never holds more
    than ``nodes.max`` participants."""
    if node in participants or not max_nodes:
        return None
    if _expected(node, members, gone):
        return None if len(participants) < max_nodes else "add_to_redundancy_list"
    room = room_for_others(participants=participants, members=members, gone=gone, max_nodes=max_nodes)
    return None if room > 0 else "add_to_redundancy_list"


def vacancy_join(*, complete: bool, participants: Collection, max_nodes: int) -> str:
    """Pure: the join operation a hot spare runs when it finds a free place, in the write
    that takes it off the redundancy list (module doc): while the round is complete with room,
    the next round's wait list (``add_to_wait_list``: whoever opens that round admits it);
    while it is open, ``add_to_participants`` (which ``join_as`` may still turn into a wait as
    a spare, the free places being the last round's members'); a full round keeps it a spare
    (``add_to_redundancy_list``)."""
    if max_nodes and len(participants) >= max_nodes:
        return "add_to_redundancy_list"
    return "add_to_wait_list" if complete else "add_to_participants"


def still_expected(*, members: Collection, gone: Collection, participants: Collection) -> set:
    """Pure: the members of the last completed round, not known ``gone``, that have not joined
    this round yet: the peers a round waits a moment for (``rules.PEER_GRACE_S``), whichever
    agent decides, a spare or a new node included, since every agent reads them from the state."""
    return set(members) - set(gone) - set(participants)


def _expected(node: object, members: Collection, gone: Collection) -> bool:
    return node in members and node not in gone


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
