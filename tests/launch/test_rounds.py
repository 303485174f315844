"""Node loss flat in the number of nodes (issue 36, item 2): real rounds of our handlers.

torch's handlers (ours, from ``create_handler``) in threads of this process against a real
c10d ``TCPStore``, as in ``test_rendezvous``. The later-round last call is a minute here and
torch's keep-alive expiry a minute too: a round that closes in seconds closed because
everyone expected was in (``rendezvous.rounds``), not because a timeout ran out.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest

from elastic_harness.rendezvous import rounds, rules
from elastic_harness.rendezvous.handler import create_handler
from tests.launch.test_liveness import exited_identity
from tests.launch.test_rendezvous import TEST_KEY, close, join_all, store  # noqa: F401 - fixture

pytestmark = pytest.mark.timeout(45)


def agent(endpoint: str, run_id: str, max_nodes: int):
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    conf = dict(join_timeout=90, last_call_timeout=60, close_timeout=10, heartbeat_timeout=5,
                keep_alive_interval=1, keep_alive_max_attempt=60, is_host=False, read_timeout=30,
                start_last_call_timeout=15)
    return create_handler(RendezvousParameters("c10d", endpoint, run_id, 1, max_nodes, **conf), key=TEST_KEY)


@pytest.mark.parametrize(("kw", "closes"), [
    ({}, True),
    ({"participants": {"a"}}, False),  # b, a member of the last round, is not in yet
    ({"gone": set()}, False),  # c was not known gone: it may still come
    ({"waiting": {"d"}}, False),  # d waits to join: the round must hold it
    ({"waiting": {"d"}, "participants": {"a", "b", "d"}}, True),
    ({"round_": 0}, False),  # the start of a submission has its own last call
    ({"members": set()}, False),
    ({"spares": {"s"}, "max_nodes": 3}, False),  # a spare has not taken c's place yet
    ({"spares": {"s"}, "max_nodes": 3, "participants": {"a", "b", "s"}}, True),
    ({"spares": {"s", "t"}, "max_nodes": 3, "participants": {"a", "b", "s"}}, True),  # room for one
    ({"spares": {"s"}, "max_nodes": 2}, True),  # no room: the spare stays one
])
def test_a_round_closes_when_every_member_not_gone_and_every_waiting_node_joined(kw, closes):
    args = {"round_": 3, "members": {"a", "b", "c"}, "gone": {"c"}, "participants": {"a", "b"},
            "waiting": set(), **kw}
    assert rounds.everyone_in(**args) is closes


def test_survivors_of_three_form_the_next_round_without_its_last_call(store):  # noqa: F811
    """Node c dies; a and b (whose workers lost it) restart: the round closes once both are
    in, not a minute later."""
    nodes = [agent(store, "three", 3) for _ in range(3)]
    nodes[2]._identity = exited_identity()
    try:
        assert join_all(nodes, [0.0, 0.0, 0.0]) == [3, 3, 3]
        nodes[2]._stop_heartbeats()  # killed
        for n in nodes[:2]:
            n.group_failed()
            n.peer_lost()
        assert join_all(nodes[:2], [0.0, 0.3]) == [2, 2]
    finally:
        close(nodes)


def test_a_failed_group_writes_its_round_broken_for_every_peer(store):  # noqa: F811
    pair = [agent(store, "broken", 2) for _ in range(2)]
    try:
        assert join_all(pair, [0.0, 0.0]) == [2, 2]
        assert not pair[0].round_broken() and not pair[1].round_broken()
        pair[0].group_failed()
        rejoined: dict = {}
        again = threading.Thread(target=lambda: rejoined.update(info=pair[0].next_rendezvous()))
        again.start()  # its exit from the round writes it broken; then it waits for the next
        deadline = threading.Event()
        for _ in range(100):  # node 1 reads the state as its agent does while its workers run
            pair[1].num_nodes_waiting()
            if pair[1].round_broken():
                break
            deadline.wait(0.1)
        assert pair[1].round_broken(), "node 1 never learned that its round is over"
        assert pair[1].next_rendezvous().world_size == 2
        again.join(30)
        assert rejoined["info"].world_size == 2
        assert not pair[1].round_broken(), "the new round is not broken"
    finally:
        close(pair)


def test_only_a_crash_breaks_the_round_not_workers_that_drained():
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.multiprocessing.api import ProcessFailure

    from elastic_harness.agent.elastic import DRAINED, crashed
    from elastic_harness.runtime.session import DRAIN_EXIT

    def failed(*codes: int) -> RunResult:
        return RunResult(state=WorkerState.FAILED, failures={
            r: ProcessFailure(local_rank=r, pid=100 + r, exitcode=c, error_file="<N/A>") for r, c in enumerate(codes)})

    assert DRAINED == DRAIN_EXIT
    assert not crashed(failed(DRAIN_EXIT, DRAIN_EXIT)), "a drain for a join its peers asked for"
    assert crashed(failed(-9)) and crashed(failed(DRAIN_EXIT, 1))


def test_a_large_group_reads_the_state_less_often():
    from elastic_harness.rendezvous.handler import RUNNING_POLL_S, poll_for

    assert poll_for(2) == poll_for(16) == RUNNING_POLL_S
    assert poll_for(1000) == 5.0, "1000 agents read the state 200 times a second together, not 4000"
    from elastic_harness.rendezvous.handler import REJOIN_POLL_S, rejoin_poll

    assert rejoin_poll(8) == REJOIN_POLL_S and rejoin_poll(1000) == 1.25


def test_a_spare_waits_reading_often_and_ends_cleanly_when_the_job_closes(store):  # noqa: F811
    from elastic_harness.agent.node import rendezvous_exit_code
    from elastic_harness.rendezvous.handler import SPARE_POLL_S

    active, spare = agent(store, "spare", 1), agent(store, "spare", 1)
    try:
        assert join_all([active], [0.0]) == [1]
        outcome: dict = {}

        def wait() -> None:
            try:
                spare.next_rendezvous()
            except Exception as e:  # noqa: BLE001 - the outcome under test
                outcome["error"] = e

        waiting = threading.Thread(target=wait)
        waiting.start()
        for _ in range(100):
            if spare._state_holder._cache_duration == SPARE_POLL_S:
                break
            threading.Event().wait(0.1)
        assert spare._state_holder._cache_duration == SPARE_POLL_S, "a spare reads the state often"
        assert spare._this_node in spare._state_holder.state.redundancy_list
        active.shutdown()  # the job finished without needing the spare
        waiting.join(30)
        kind = type(outcome.get("error")).__name__
        assert kind == "RendezvousGracefulExitError" and rendezvous_exit_code(kind) == 0
    finally:
        close([active, spare])


def test_the_first_agent_of_an_open_round_admits_every_waiting_agent_with_itself():
    from elastic_harness.rendezvous.rounds import admitted

    assert admitted(participants={"a"}, waiting={"c", "b"}, max_nodes=8) == ["b", "c"]
    assert admitted(participants={"a"}, waiting={"d", "c", "b"}, max_nodes=3) == ["b", "c"], "no more than the room"
    assert admitted(participants={"a", "b"}, waiting={"b"}, max_nodes=3) == []
    assert admitted(participants={"a", "b", "c"}, waiting={"d"}, max_nodes=3) == [], "a full round admits nobody"


# --- never more than nodes.max (issue 42: hot spares deadlocked a crash recovery) -----------

def pair_agent(endpoint: str, run_id: str):
    """An agent of a job of exactly two nodes (``nodes.min = nodes.max = 2``), as the issue's."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    conf = dict(join_timeout=60, last_call_timeout=60, close_timeout=10, heartbeat_timeout=5,
                keep_alive_interval=1, keep_alive_max_attempt=60, is_host=False, read_timeout=30,
                start_last_call_timeout=15)
    return create_handler(RendezvousParameters("c10d", endpoint, run_id, 2, 2, **conf), key=TEST_KEY)


def write_state(handler, **fields) -> None:
    """Write the rendezvous state through ``handler``'s holder with ``fields`` changed (its
    own sealed write, as an agent's): torch's fields on its state, ``members`` and ``gone``
    beside it (``rules.Ours``)."""
    holder = handler._state_holder
    holder.sync()
    state = holder.state
    ours = {name: frozenset(fields.pop(name)) for name in ("members", "gone") if name in fields}
    handler._seal.beside = replace(handler._seal.beside or rules.Ours(), **ours)  # our fields, beside torch's
    for name, value in fields.items():
        setattr(state, name, value)
    now = datetime.now(timezone.utc)
    for node in [*state.participants, *state.wait_list, *state.redundancy_list]:
        state.last_heartbeats[node] = now
    holder.mark_dirty()
    holder.sync()


def joining(handler) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["info"] = handler.next_rendezvous()
        except Exception as e:  # noqa: BLE001 - the outcome under test
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def in_join(*handlers, round_: int) -> None:
    """Wait until each handler read ``round_`` in its ``next_rendezvous``: its exit from its
    last round is behind it (an agent admitted before that would leave the round again)."""
    for h in handlers:
        for _ in range(200):
            if getattr(h._state_holder.state, "round", None) == round_:
                break
            threading.Event().wait(0.05)


def read_state(handler):
    holder = handler._state_holder
    holder._last_sync_time = -1.0
    with handler._heartbeat_lock:
        holder.sync()
    return holder.state


def test_a_round_filled_by_admitting_the_wait_list_is_complete_with_the_members_and_spares_stay_spares(store):  # noqa: F811
    """A worker crash with a hot spare: member a left the round and waits for the next one,
    and the spare left the redundancy list for the wait list (the round had room for a
    moment). Member b leaves last and opens the next round: it admits a (not the spare,
    which sorts first), the round is complete in that same write, and the spare is back in
    the redundancy list (left waiting, it would read to the running agents as a node waiting
    to join, and restart their group again and again). Before, the round stayed open with
    two participants and a's own join made it three: no rule completes that."""
    spare = pair_agent(store, "fill")  # made first: it sorts before the members
    a, b = pair_agent(store, "fill"), pair_agent(store, "fill")
    me = {h._this_node: name for h, name in ((spare, "spare"), (a, "a"), (b, "b"))}
    try:
        write_state(a, round=3, complete=True, participants={b._this_node: 0},
                    wait_list={a._this_node, spare._this_node}, members={a._this_node, b._this_node},
                    deadline=None)
        spare_join, a_join = joining(spare), joining(a)
        in_join(a, spare, round_=3)
        b_join = joining(b)  # b's exit opens round 4
        for thread, _ in (a_join, b_join):
            thread.join(20)
        assert [j[1].get("info") and j[1]["info"].world_size for j in (a_join, b_join)] == [2, 2], (a_join, b_join)
        state = read_state(b)
        assert state.complete and {me[n] for n in state.participants} == {"a", "b"}
        assert {me[n] for n in state.redundancy_list} == {"spare"} and not state.wait_list
        assert a.num_nodes_waiting() == 0, "no one waits: the running agents do not restart for the spare"
        assert spare_join[0].is_alive() and "error" not in spare_join[1], "the spare still waits"
        a.shutdown()  # the job ends: the spare leaves cleanly
        spare_join[0].join(30)
    finally:
        close([spare, a, b])


def test_a_join_of_a_full_open_round_waits_as_a_spare_instead_of_overfilling_it(store):  # noqa: F811
    """A round open with ``nodes.max`` participants (as an admission left it before) and a
    spare still on the wait list: the spare's own join made it ``nodes.max + 1``, and no
    agent could ever complete it. Now the spare waits in the redundancy list, and the two
    members complete the round at its deadline."""
    a, b, spare, writer = (pair_agent(store, "full") for _ in range(4))
    me = {h._this_node: name for h, name in ((spare, "spare"), (a, "a"), (b, "b"))}
    try:
        everyone = {a._this_node, b._this_node, spare._this_node}
        write_state(writer, round=3, complete=True, participants={writer._this_node: 0}, wait_list=everyone)
        joins = [joining(h) for h in (a, b, spare)]
        in_join(a, b, spare, round_=3)
        write_state(writer, round=4, complete=False, participants={a._this_node: 0, b._this_node: 0},
                    wait_list={spare._this_node}, members={a._this_node, b._this_node},
                    deadline=datetime.now(timezone.utc) + timedelta(seconds=1.5))
        for _ in range(100):  # the spare's join, while the round is still open (its deadline: 1.5 s)
            state = read_state(writer)
            if spare._this_node in state.redundancy_list or spare._this_node in state.participants:
                break
            threading.Event().wait(0.02)
        assert not state.complete and spare._this_node in state.redundancy_list
        assert spare._this_node not in state.wait_list, "on both lists (torch then lost its keep-alive)"
        for thread, _ in joins[:2]:
            thread.join(20)
        assert [j[1].get("info") and j[1]["info"].world_size for j in joins[:2]] == [2, 2], joins
        state = read_state(a)
        assert {me[n] for n in state.participants} == {"a", "b"}, "the spare overfilled the round"
        assert {me[n] for n in state.redundancy_list} == {"spare"} and not state.wait_list
        assert joins[2][0].is_alive() and "error" not in joins[2][1], "the spare still waits"
        a.shutdown()  # the job ends: the spare leaves cleanly
        joins[2][0].join(30)
    finally:
        close([a, b, spare, writer])


def test_the_places_of_the_last_rounds_members_are_theirs_and_a_round_never_overfills():
    members, gone = {"a", "b"}, set()
    assert rounds.admitted(participants={"b"}, waiting={"a", "0spare"}, max_nodes=2, members=members) == ["a"]
    assert rounds.admitted(participants={"a"}, waiting={"0spare"}, max_nodes=2, members=members) == [], \
        "b restarts and rejoins within moments: its place is not the spare's"
    assert rounds.admitted(participants={"a"}, waiting={"0spare"}, max_nodes=2, members=members,
                           gone={"b"}) == ["0spare"], "b is known gone: the spare takes its place"
    assert rounds.admitted(participants={"a"}, waiting={"d", "c"}, max_nodes=3, members=members) == ["c"]
    assert rounds.join_as(node="0spare", participants={"a"}, max_nodes=2, members=members, gone=gone) == \
        "add_to_redundancy_list"
    assert rounds.join_as(node="0spare", participants={"a"}, max_nodes=2, members=members, gone={"b"}) is None
    assert rounds.join_as(node="b", participants={"a"}, max_nodes=2, members=members, gone=gone) is None
    assert rounds.join_as(node="b", participants={"a", "x"}, max_nodes=2, members=members, gone=gone) == \
        "add_to_redundancy_list", "even a member never makes a round nodes.max + 1"
    assert rounds.join_as(node="c", participants={"a"}, max_nodes=0) is None, "no nodes.max: no limit"
    assert rounds.stay_spares(participants={"a", "b"}, waiting={"s", "t"}, max_nodes=2) == ["s", "t"]
    assert rounds.stay_spares(participants={"a"}, waiting={"s"}, max_nodes=2) == [], "room: it waits to join"


# --- a hot spare takes a lost node's place in the first round after the loss ---------------

def test_a_spare_that_finds_a_free_place_is_listed_elsewhere_in_the_same_write():
    assert rounds.vacancy_join(complete=True, participants={"a"}, max_nodes=2) == "add_to_wait_list"
    assert rounds.vacancy_join(complete=False, participants={"a"}, max_nodes=2) == "add_to_participants"
    assert rounds.vacancy_join(complete=False, participants=set(), max_nodes=2) == "add_to_participants"
    assert rounds.vacancy_join(complete=False, participants={"a", "b"}, max_nodes=2) == "add_to_redundancy_list"
    assert rounds.still_expected(members={"a", "b"}, gone={"b"}, participants={"s"}) == {"a"}
    assert rounds.still_expected(members={"a", "b"}, gone={"b"}, participants={"s", "a"}) == set()
    assert rounds.still_expected(members=(), gone=(), participants={"s"}) == set(), "round 0: no members yet"


def test_a_spare_that_opens_the_round_after_a_loss_waits_for_the_survivor_not_its_own_peers():
    """Node b was lost; survivor a has left round 0 and not yet joined round 1 (its exit and
    its join are two writes), and spare s joins round 1 first. s was in no round with a: it
    waited for nobody, closed round 1 alone, and a joined the round after (world sizes 2, 1,
    2). The last round's members not known gone are in the state, for every agent to wait for."""
    from types import SimpleNamespace

    from elastic_harness.rendezvous.handler import PEER_GRACE_S, RoundTimeout

    timeout = RoundTimeout(join=60, start_last_call=15, last_call=2, close=10, heartbeat=5)
    state = SimpleNamespace(round=1, participants={"s": 0}, wait_list=set(), redundancy_list=set())
    ours = SimpleNamespace(now=rules.Ours(members=frozenset({"a", "b"}), gone=frozenset({"b"})))
    timeout.follow(lambda: state, lambda: ours.now)
    assert timeout.last_call.total_seconds() == PEER_GRACE_S
    state.participants = {"s": 0, "a": 0}
    assert timeout.last_call.total_seconds() == 0.0, "everyone expected is in: no wait"
    ours.now = replace(ours.now, members=frozenset())  # a fresh round 1 (no round completed before): as before
    state.participants = {"s": 0}
    assert timeout.last_call.total_seconds() == 0.0


def recorded_writes(handler) -> list[tuple[set, bool]]:
    """Each state ``handler`` writes from now on, as (the lists it is on, has it a keep-alive)."""
    holder, me, seen = handler._state_holder, handler._this_node, []
    sync = holder.sync

    def recording():
        wrote = sync()
        if wrote:
            state = holder.state
            lists = {name for name, nodes in (("participants", state.participants), ("waiting", state.wait_list),
                                              ("spares", state.redundancy_list)) if me in nodes}
            seen.append((lists, me in state.last_heartbeats))
        return wrote

    holder.sync = recording
    return seen


def test_a_spare_is_on_a_list_in_every_write_and_takes_the_lost_nodes_place(store):  # noqa: F811
    """Node b was lost and dropped from round 3; survivor a is still its participant; spare s
    sees the free place. torch took s off the redundancy list, and its keep-alive, in one
    write, and listed it for the next round in another: a survivor opening that round in
    between saw nobody coming and closed it alone. Now s is listed in every write it makes,
    and a, opening round 4, admits it: the same world size, in one round."""
    a, spare, writer = (agent(store, "vacancy", 2) for _ in range(3))
    b = writer._this_node  # the lost node: its name only
    me = {a._this_node: "a", spare._this_node: "spare"}
    try:
        write_state(writer, round=3, complete=True, participants={a._this_node: 0},
                    redundancy_list={spare._this_node}, wait_list=set(), members={a._this_node, b}, gone={b},
                    deadline=None)
        writes = recorded_writes(spare)
        spare_join = joining(spare)
        for _ in range(200):
            if spare._this_node in read_state(writer).wait_list:
                break
            threading.Event().wait(0.05)
        assert writes and all(lists and alive for lists, alive in writes), writes
        a_join = joining(a)  # its exit from round 3 opens round 4, and its join admits the spare
        for thread, _ in (a_join, spare_join):
            thread.join(20)
        assert [j[1].get("info") and j[1]["info"].world_size for j in (a_join, spare_join)] == [2, 2], (a_join, spare_join)
        state = read_state(writer)
        assert state.round == 4 and state.complete and {me[n] for n in state.participants} == {"a", "spare"}
    finally:
        close([a, spare, writer])


def test_a_spare_that_joins_before_the_survivor_waits_for_it(store, monkeypatch):  # noqa: F811
    """Round 4 opened by survivor a's exit (its participants empty), a not in it yet: spare s
    joins first. It used to close the round alone at once. The grace is widened here so that a
    loaded machine cannot make a's join late: what is tested is that s waits at all."""
    monkeypatch.setattr(rules, "PEER_GRACE_S", 20.0)
    a, spare, writer = (agent(store, "first", 2) for _ in range(3))
    b = writer._this_node
    me = {a._this_node: "a", spare._this_node: "spare"}
    try:
        write_state(writer, round=4, complete=False, participants={}, redundancy_list={spare._this_node},
                    wait_list=set(), members={a._this_node, b}, gone={b}, deadline=None)
        spare_join = joining(spare)
        for _ in range(200):
            if spare._this_node in read_state(writer).participants:
                break
            threading.Event().wait(0.05)
        assert not read_state(writer).complete, "the spare closed the round without the survivor"
        a_join = joining(a)
        for thread, _ in (a_join, spare_join):
            thread.join(20)
        assert [j[1].get("info") and j[1]["info"].world_size for j in (a_join, spare_join)] == [2, 2], (a_join, spare_join)
        state = read_state(writer)
        assert state.round == 4 and {me[n] for n in state.participants} == {"a", "spare"}
    finally:
        close([a, spare, writer])


def test_our_fields_travel_beside_torchs_state_sealed_never_on_its_object(store):  # noqa: F811
    """``members``, ``gone``, ``broken`` and ``lives`` are ours (``rules.Ours``): sealed with
    torch's pickled state (``sealed.pack``), read back by every agent, and torch's object
    carries its own fields only."""
    from elastic_harness.torchcompat.rdzv import STATE_FIELDS

    pair = [agent(store, "beside", 2) for _ in range(2)]
    try:
        assert join_all(pair, [0.0, 0.0]) == [2, 2]
        pair[0].group_failed()
        read_state(pair[0])
        pair[0]._state_holder.mark_dirty()  # its next write carries the round broken
        with pair[0]._heartbeat_lock:
            pair[0]._state_holder.sync()
        state = read_state(pair[1])
        assert set(vars(state)) <= set(STATE_FIELDS), "nothing of ours on torch's object"
        beside = pair[1]._seal.beside
        nodes = {h._this_node for h in pair}
        assert beside.members == nodes and beside.broken == state.round and set(beside.lives) == nodes
    finally:
        close(pair)
