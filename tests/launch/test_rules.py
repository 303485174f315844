"""The rendezvous' decisions (``rendezvous.rules``) as tables of cases: no store, no process.

Each case is a view of torch's state (``torchcompat.rdzv.StateView``), our fields beside it
(``rules.Ours``) and this agent's memory (``rules.Memory``), and the action the rules return.
The handler that applies them is tested against a real store in test_rounds, test_liveness
and test_rendezvous.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from elastic_harness.rendezvous import rules
from elastic_harness.torchcompat.rdzv import StateView

pytestmark = pytest.mark.timeout(30)

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


def view(*, round_=3, complete=False, participants=(), waiting=(), spares=(), beats=None) -> StateView:
    nodes = {*participants, *waiting, *spares}
    return StateView(round=round_, complete=complete, participants=dict.fromkeys(participants, 0),
                     wait_list=frozenset(waiting), redundancy_list=frozenset(spares),
                     last_heartbeats=beats if beats is not None else dict.fromkeys(nodes, NOW))


def ours(members=(), gone=(), broken=None, lives=None) -> rules.Ours:
    return rules.Ours(broken=broken, members=frozenset(members), gone=frozenset(gone), lives=lives or {})


@pytest.mark.parametrize(("case", "state", "beside", "limits", "want"), [
    ("the first joiner admits the waiting members; the round reaches nodes.min",
     view(participants={"a"}, waiting={"b", "c"}), ours({"a", "b", "c"}), (3, 4),
     rules.Admission(admit=("b", "c"), last_call_starts=True, complete=True)),
    ("admitted up to nodes.max: complete in this write, the rest stay waiting",
     view(participants={"a"}, waiting={"b", "c"}), ours(), (1, 2),
     rules.Admission(admit=("b",), complete=True)),
    ("a member's place is not a spare's",
     view(participants={"a"}, waiting={"0spare"}), ours({"a", "b"}), (1, 2),
     rules.Admission()),
    ("nobody waits, everyone expected is in: the round completes in this write",
     view(participants={"a", "b"}), ours({"a", "b", "c"}, gone={"c"}), (1, 4),
     rules.Admission(complete=True)),
    ("a member not known gone is still to come: the last call runs",
     view(participants={"a"}), ours({"a", "b"}), (1, 4), rules.Admission()),
    ("round 0 has its own last call: never closed early",
     view(round_=0, participants={"a"}), ours({"a"}), (1, 4), rules.Admission()),
    ("a complete round: nothing",
     view(complete=True, participants={"a"}, waiting={"b"}), ours(), (1, 4), rules.Admission()),
])
def test_admission(case, state, beside, limits, want):
    assert rules.admission(state, beside, min_nodes=limits[0], max_nodes=limits[1]) == want, case


def test_completion_records_the_members_and_keeps_spares_that_keep_alive():
    state = view(complete=True, participants={"a", "b"}, waiting={"s", "t"},
                 beats={"a": NOW, "b": NOW, "s": NOW})  # t has no keep-alive: no spare
    done = rules.completion(state, ours({"x"}, gone={"x"}, broken=2), max_nodes=2)
    assert done == rules.Completion(ours=ours({"a", "b"}, broken=2), spares=("s",))
    assert rules.completion(state, ours(), max_nodes=4).spares == (), "room: they wait to join"


@pytest.mark.parametrize(("case", "mine", "condemned", "answers", "silent_s", "want_broken", "want_drops"), [
    ("no failure: nothing", rules.Memory(round=3, peers=frozenset({"me", "a"})), (), {"a": True}, {}, None, ()),
    ("a failed group writes its round broken; no evidence against a peer: nobody dropped",
     rules.Memory(round=3, peers=frozenset({"me", "a"}), failed=True), (), {"a": True}, {}, 3, ()),
    ("a lost peer whose process is gone is dropped",
     rules.Memory(round=3, peers=frozenset({"me", "a"}), evidence=True), (), {"a": True}, {}, 3,
     (rules.Drop("a", "gone"),)),
    ("a peer of another host, silent past the bound, is dropped",
     rules.Memory(round=3, peers=frozenset({"me", "a"}), evidence=True), (), {"a": None}, {"a": 5}, 3,
     (rules.Drop("a", "silent"),)),
    ("a live process is never dropped, however silent",
     rules.Memory(round=3, peers=frozenset({"me", "a"}), evidence=True), (), {"a": False}, {"a": 60}, 3, ()),
    ("a peer the stall verdict condemned is dropped",
     rules.Memory(round=3, peers=frozenset({"me", "a"})), ("a",), {"a": False}, {}, 3,
     (rules.Drop("a", "condemned"),)),
    ("not this agent's round: nothing",
     rules.Memory(round=2, peers=frozenset({"me", "a"}), evidence=True, failed=True), (), {"a": True}, {}, None, ()),
])
def test_on_sync(case, mine, condemned, answers, silent_s, want_broken, want_drops):
    beats = {n: NOW - timedelta(seconds=silent_s.get(n, 0.5)) for n in ("me", "a")}
    lives = {"me": "id-me", "a": "id-a", "left": "id-left"}  # "left" has no keep-alive any more
    state = view(complete=True, participants={"me", "a"}, beats=beats)
    sync = rules.on_sync(state, ours({"me", "a"}, lives=lives), mine, me="me", condemned=frozenset(condemned),
                         gone=lambda who: answers.get(who.removeprefix("id-")) if who else None,
                         stale=NOW - timedelta(seconds=2))
    assert (sync.ours.broken, sync.drops) == (want_broken, want_drops), case
    dropped = {d.node for d in want_drops}
    assert set(sync.ours.lives) == {"me", "a"} - dropped, "a node's lives entry goes with its keep-alive"
    assert sync.ours.gone == dropped


def test_expired_are_the_nodes_torchs_expiry_drops():
    state = view(beats={"a": NOW - timedelta(seconds=4), "b": NOW - timedelta(seconds=2)})
    assert rules.expired(state, now=NOW, expiry=timedelta(seconds=3)) == {"a"}


@pytest.mark.parametrize(("case", "state", "beside", "peers", "want"), [
    ("round 0: the start last call", view(round_=0), ours(), (), 15.0),
    ("others waiting: the later last call", view(participants={"a"}, waiting={"w"}), ours(), (), 3.0),
    ("a peer of my last round not back yet: the grace", view(participants={"a"}), ours(), {"a", "b"},
     rules.PEER_GRACE_S),
    ("a member of the last round not known gone, whoever decides: the grace", view(participants={"s"}),
     ours({"a", "b"}, gone={"b"}), (), rules.PEER_GRACE_S),
    ("nobody coming: close now", view(participants={"s", "a"}), ours({"a", "b"}, gone={"b"}), (), 0.0),
])
def test_last_call(case, state, beside, peers, want):
    assert rules.last_call(state, beside, peers, start_s=15.0, later_s=3.0) == want, case


@pytest.mark.parametrize(("seconds", "pace", "want"), [
    ((0, 0.3), rules.Pace(), (0, 0.3)),  # the first join: torch's start-up skew
    ((0, 0.3), rules.Pace(restart=True), None),  # a restart: none
    (1, rules.Pace(), rules.POLL_S),  # torch's 1 s poll, cut
    (1, rules.Pace(poll=rules.SPARE_POLL_S), rules.SPARE_POLL_S),  # a hot spare
    (0.01, rules.Pace(), 0.01),
])
def test_pause(seconds, pace, want):
    assert rules.pause(seconds, pace) == want


def test_joins_and_vacancies_follow_the_rounds_rules():
    state = view(participants={"a"})
    assert rules.join_as(state, ours({"a", "b"}), me="0spare", max_nodes=2) == "add_to_redundancy_list"
    assert rules.join_as(state, ours({"a", "b"}, gone={"b"}), me="0spare", max_nodes=2) is None
    assert rules.vacancy(view(complete=True, participants={"a"}), max_nodes=2) == "add_to_wait_list"
    assert rules.vacancy(view(participants={"a", "b"}), max_nodes=2) == "add_to_redundancy_list"


def test_a_round_is_broken_when_written_so_or_moved_on_never_before_one_formed():
    mine = rules.Memory(formed=True, round=3)
    assert not rules.round_broken(view(), ours(), mine)
    assert rules.round_broken(view(), ours(broken=3), mine)
    assert rules.round_broken(view(round_=4), ours(), mine)
    assert not rules.round_broken(view(round_=4), ours(broken=3), rules.Memory())


def test_the_shape_of_the_state_others_act_on():
    base = rules.shape(view(participants={"a"}), ours())
    assert rules.shape(view(participants={"a", "b"}), ours()) == base, "a join alone is not announced"
    assert rules.shape(view(participants={"a"}), ours(broken=3)) != base
    assert rules.shape(view(participants={"a"}, waiting={"w"}), ours()) != base


@pytest.mark.parametrize(("age_s", "again"), [
    (0.0, False),
    (rules.RUNNING_POLL_S * 1.5, False),  # a running agent's view: one poll late at most
    (rules.STALE_VIEW_S + 0.01, True),  # frozen or cut off meanwhile: its view may predate its drop
    (1e9, True),  # never read since the hook was installed
])
def test_whether_a_drop_is_judged_on_a_new_read(age_s, again):
    assert rules.judged_on_a_new_read(age_s) is again
