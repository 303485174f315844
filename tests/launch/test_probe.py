"""Another host's agent, gone or alive (``rendezvous.probe``, issue 36 item 3): its beacon.

The beacon's three answers from real sockets, then real rendezvous rounds (torch's handlers
in threads against a real c10d store, as in ``test_liveness``) where node 1 is "another
host": its identity names another boot, so only its beacon can tell.
"""

from __future__ import annotations

import socket
import threading
from datetime import timedelta

import pytest

from elastic_harness.rendezvous import liveness, probe
from tests.launch.test_liveness import agent, close, join_all
from tests.launch.test_rendezvous import store  # noqa: F401 - fixture

pytestmark = pytest.mark.timeout(90)


def test_a_beacon_answers_while_open_and_is_refused_once_closed():
    beacon = probe.Beacon("127.0.0.1").start()
    assert probe.probe(beacon.address, 5.0) == probe.ALIVE
    beacon.close()
    assert probe.probe(beacon.address, 5.0) == probe.GONE


def test_a_closed_beacon_ends_its_thread_and_the_next_handler_opens_another():
    """One beacon per process (``handler._beacon``), open until ``close_beacon``: a process that
    made handlers and lives on (this one) is left without the beacon's thread."""
    from elastic_harness.rendezvous import handler

    first = handler._beacon("127.0.0.1")
    assert handler._beacon("127.0.0.1") == first
    handler.close_beacon()
    assert probe.probe(first, 5.0) == probe.GONE
    assert "liveness-beacon" not in [t.name for t in threading.enumerate()]
    second = handler._beacon("127.0.0.1")
    try:
        assert second != first and probe.probe(second, 5.0) == probe.ALIVE
    finally:
        handler.close_beacon()


def test_a_frozen_agent_is_silent_not_gone():
    """A stopped process's kernel still accepts the connection; nobody answers."""
    with socket.socket() as frozen:
        frozen.bind(("127.0.0.1", 0))
        frozen.listen(8)  # never accepts: a SIGSTOPped agent's beacon
        port = frozen.getsockname()[1]
        assert probe.probe(f"127.0.0.1:{port}", 0.3) == probe.SILENT
    assert probe.probe("no-port", 0.3) == probe.SILENT


def test_the_asker_keeps_answers_a_while_and_gone_for_good():
    asked, now = [], [0.0]
    answers = iter([probe.SILENT, probe.ALIVE, probe.GONE, probe.ALIVE])
    ask = probe.Asker(keep_s=1.0, ask=lambda a, t: asked.append(a) or next(answers), clock=lambda: now[0])
    assert ask("x:1") == probe.SILENT and ask("x:1") == probe.SILENT and len(asked) == 1
    now[0] = 1.5
    assert ask("x:1") == probe.ALIVE
    now[0] = 3.0
    assert ask("x:1") == probe.GONE
    now[0] = 60.0
    assert ask("x:1") == probe.GONE and len(asked) == 3


OTHER = "another-boot/77/2/3"  # node 1 runs on another host: its pid tells this one nothing


@pytest.mark.parametrize(("answer", "verdict"), [(probe.GONE, True), (probe.ALIVE, False),
                                                 (probe.SILENT, None)])
def test_another_hosts_node_is_judged_by_its_beacon(answer, verdict):
    assert liveness.gone(f"{OTHER}|10.0.0.2:4242", ask=lambda address: answer) is verdict
    assert liveness.gone(OTHER, ask=lambda address: answer) is None, "no beacon: nothing to ask"


def test_this_hosts_pid_is_asked_before_any_beacon():
    mine = liveness.identity("10.0.0.2:1")
    assert liveness.gone(mine, ask=lambda address: probe.GONE) is False


def pair_with_remote(endpoint: str, run_id: str, beacon: str):
    """Two of our handlers; node 1 says it runs on another host with ``beacon``. torch's
    expiry is 60 s and the silence rule's two keep-alive intervals beyond the join timeout
    (40 s): only the beacon can drop it in time."""
    pair = [agent(endpoint, run_id, keep_alive_interval=30, keep_alive_max_attempt=2) for _ in range(2)]
    pair[1]._identity = f"{OTHER}|{beacon}"
    assert join_all(pair, [0.0, 0.0]) == [2, 2]
    return pair


def test_a_node_whose_host_refuses_its_beacon_is_dropped_at_once(store):  # noqa: F811
    dead = probe.Beacon("127.0.0.1")
    dead.close()  # its process died: the host refuses connections to its port
    pair = pair_with_remote(store, "refused", dead.address)
    pair[1]._stop_heartbeats()
    try:
        pair[0].peer_lost()
        assert pair[0].next_rendezvous().world_size == 1
    finally:
        close(pair)


def test_a_node_whose_beacon_answers_is_kept_however_silent(store):  # noqa: F811
    """Its keep-alives are a minute old (as the state says), but its agent answers: alive."""
    live = probe.Beacon("127.0.0.1").start()
    pair = [agent(store, "answers") for _ in range(2)]
    pair[1]._identity = f"{OTHER}|{live.address}"
    try:
        assert join_all(pair, [0.0, 0.0]) == [2, 2]
        pair[0].peer_lost()
        state = pair[0]._state_holder.state
        state.last_heartbeats[pair[1]._this_node] -= timedelta(seconds=60)
        assert pair[0].drop_dead(state) == frozenset()
        assert pair[1]._this_node in state.participants
        live.close()  # now its process is gone
        pair[0]._ask = probe.Asker()  # forget the answer it kept
        assert pair[0].drop_dead(state) == {pair[1]._this_node}
    finally:
        close(pair)
