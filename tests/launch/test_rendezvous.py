"""The last call per rendezvous round (``rendezvous.handler``): the decision, and real rounds.

The rounds run torch's own rendezvous handlers, one per simulated agent, in threads of this
process against a real c10d ``TCPStore`` (a node is a handler: torch names it by address,
pid and a per-process counter). Starting them with a skew between them is what agents
started together do (each imports torch first, which takes seconds on a loaded machine).
"""

from __future__ import annotations

import datetime as dt
import threading
from types import SimpleNamespace

import pytest

from elastic_harness.launch.config import NodeOptions, rdzv_configs
from elastic_harness.rendezvous.handler import (
    POLL_S,
    RoundTimeout,
    create_handler,
    last_call_s,
    timeout_from,
)
from elastic_harness.spec import parse_job

pytestmark = pytest.mark.timeout(90)
TEST_KEY = b"k" * 32  # the job's key (``jobkey``): ours seal the rendezvous state with it


@pytest.mark.parametrize(("round_", "waiting", "missing", "want"), [
    (0, 0, 0, 15.0),  # start-up: wait for the agents still starting
    (0, 3, 0, 15.0),
    (1, 1, 0, 3.0),  # later: others are listed as waiting for this round
    (1, 1, 1, 3.0),
    (3, 0, 1, 1.0),  # later: a peer of the last round left it and has not joined yet
    (4, 0, 0, 0.0),  # later, nobody else coming: close now
])
def test_last_call_per_round(round_, waiting, missing, want):
    assert last_call_s(round_, waiting, missing, start_s=15.0, later_s=3.0) == want


def test_others_waiting_get_two_polls_at_least():
    """A waiting agent reads the state once a poll: a last call of one poll closed the
    round on the poll it would have joined at (seen with torch's 1 s poll and 1 s)."""
    assert last_call_s(2, 1, start_s=15.0, later_s=POLL_S) == 2 * POLL_S
    assert last_call_s(2, 1, start_s=15.0, later_s=1.0) == 1.0
    assert last_call_s(2, 1, start_s=15.0, later_s=5.0) == 5.0
    assert last_call_s(2, 0, 1, start_s=15.0, later_s=0.5) == 0.5, "the peer grace stays <= later_s"


def state(round_: int, waiting: int = 0, redundant: int = 0, participants=()) -> SimpleNamespace:
    return SimpleNamespace(round=round_, wait_list={f"w{i}" for i in range(waiting)},
                           redundancy_list={f"r{i}" for i in range(redundant)},
                           participants=dict.fromkeys(participants, 0))


def test_round_timeout_reads_the_state_torch_is_changing():
    t = RoundTimeout(join=60, start_last_call=15, last_call=2, close=10, heartbeat=5)
    assert t.last_call == dt.timedelta(seconds=2), "before follow(): the configured value"
    current = {"s": state(0)}
    t.follow(lambda: current["s"])
    assert t.last_call == dt.timedelta(seconds=15)
    current["s"] = state(2, redundant=1)  # a node beyond nodes.max counts as coming too
    assert t.last_call == dt.timedelta(seconds=2)
    current["s"] = state(2)
    assert t.last_call == dt.timedelta(0)
    t.remember({"a": 0, "b": 1})  # this agent's last round was a and b
    current["s"] = state(3, participants=["a"])
    assert t.last_call == dt.timedelta(seconds=1), "b left the last round and is about to join"
    current["s"] = state(3, participants=["a", "b"])
    assert t.last_call == dt.timedelta(0)
    assert (t.join, t.close, t.heartbeat) == tuple(dt.timedelta(seconds=s) for s in (60, 10, 5))


def test_spec_reaches_the_handler_config(tmp_path):
    spec = parse_job("", ["task.target=elastic_harness.tasks.mlp:MLPRegression",
                          "rendezvous.start_last_call_timeout=20", "rendezvous.keep_alive_max_attempt=4"])
    opts = NodeOptions(tmp_path, "127.0.0.1:1", "id", "c10d", 1, 2, 1, 0)
    conf = rdzv_configs(spec, opts)
    assert conf["start_last_call_timeout"] == 20 and conf["keep_alive_max_attempt"] == 4
    params = SimpleNamespace(get=lambda k, d=None: conf.get(k, d))
    t = timeout_from(params)  # type: ignore[arg-type]
    assert (t.start_last_call.total_seconds(), t.later_last_call.total_seconds()) == (20.0, 2.0)


# --- real rounds --------------------------------------------------------------------------


@pytest.fixture
def store(monkeypatch):
    import torch.distributed as dist

    # As our agents run (launch.config.agent_environ): no store server per rank-0 agent.
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield f"127.0.0.1:{server.port}"
    del server


def agent(endpoint: str, run_id: str, ours: bool, later_s: int = 1, start_s: int = 15,
          keep_alive: int = 1):
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    conf = dict(join_timeout=30, last_call_timeout=later_s, close_timeout=10, heartbeat_timeout=5,
                keep_alive_interval=keep_alive, keep_alive_max_attempt=2, is_host=False, read_timeout=30)
    if ours:
        conf["start_last_call_timeout"] = start_s
    params = RendezvousParameters("c10d", endpoint, run_id, 1, 2, **conf)
    return create_handler(params, key=TEST_KEY) if ours else get_rendezvous_handler(params)


def join_all(handlers, skews: list[float] | None = None) -> list[int]:
    """Each handler joins the next round after its skew (seconds; default none), from a
    thread of its own; their world sizes. Any handler's error fails the test."""
    skews = skews or [0.0] * len(handlers)
    sizes: list[int] = [0] * len(handlers)
    errors: list[BaseException] = []
    started = threading.Barrier(len(handlers))

    def one(i: int) -> None:
        try:
            started.wait()
            threading.Event().wait(skews[i])  # this agent is slower to start: the race's input
            sizes[i] = handlers[i].next_rendezvous().world_size
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(handlers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return sizes


def close(handlers) -> None:
    for h in handlers:
        h._stop_heartbeats()
        getattr(h, "stop_changes", lambda: None)()  # before the store goes (``rendezvous.changes``)


def test_agents_starting_together_always_form_one_group(store):
    """Eight starts of two agents, the second up to 3 s late (beyond the 1 s later-round
    last call): every start forms one 2-node group. Starts run side by side, each its own
    rendezvous id on the one store."""
    skews = [0.0, 0.2, 0.6, 1.1, 1.5, 2.0, 2.5, 3.0]
    pairs = [[agent(store, f"start-{k}", ours=True) for _ in range(2)] for k in range(len(skews))]
    results: dict[int, list[int]] = {}

    def start(k: int) -> None:
        results[k] = join_all(pairs[k], [0.0, skews[k]])

    threads = [threading.Thread(target=start, args=(k,)) for k in range(len(skews))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(80)
    try:
        assert {k: v for k, v in results.items() if v != [2, 2]} == {}
        assert len(results) == len(skews)
    finally:
        close([h for pair in pairs for h in pair])


def test_control_torchs_handler_with_a_short_last_call_races(store):
    """The same start with torch's handler and the same 1 s last call: the first agent
    forms a group alone, which is the start-up race the per-round last call removes."""
    pair = [agent(store, "control", ours=False) for _ in range(2)]
    first = threading.Thread(target=lambda: setattr(first, "info", pair[0].next_rendezvous()))
    first.start()
    first.join(30)
    try:
        assert first.info.world_size == 1
    finally:
        close(pair)


def test_a_group_restarting_together_stays_one_group(store):
    """After a worker crash every agent of the group restarts at about the same moment: the
    next rounds still hold both (the first to join waits for its previous peer)."""
    pair = [agent(store, "crash", ours=True) for _ in range(2)]
    try:
        assert join_all(pair, [0.0, 0.0]) == [2, 2]
        for skew in (0.0, 0.05, 0.3, 0.0, 0.1):
            assert join_all(pair, [0.0, skew]) == [2, 2], skew
    finally:
        close(pair)


def test_only_the_first_join_gets_torchs_start_up_skew(store, monkeypatch):
    """torch sleeps a random 0-0.3 s before joining while the state's round reads 0, which
    it still does at the first restart; our handler keeps it for the start only."""
    from elastic_harness.rendezvous import handler as rendezvous

    asked: list = []
    monkeypatch.setattr(rendezvous, "TORCH_DELAY", asked.append)
    pair = [agent(store, "skew", ours=True) for _ in range(2)]
    try:
        assert join_all(pair, [0.0, 0.0]) == [2, 2]
        assert asked.count((0, 0.3)) == 2  # each agent's first join
        asked.clear()
        assert join_all(pair, [0.0, 0.0]) == [2, 2]  # the restart after a worker crash
        assert (0, 0.3) not in asked
    finally:
        close(pair)


def test_survivor_of_a_lost_node_closes_the_next_round_alone(store):
    """After a node is lost, the survivor's round has nobody else waiting: it closes after
    the peer grace, with the survivor alone, once the lost node's keep-alives expired."""
    pair = [agent(store, "loss", ours=True) for _ in range(2)]
    assert join_all(pair, [0.0, 0.0]) == [2, 2]
    pair[1]._stop_heartbeats()  # node 1 is gone: no more keep-alives, no goodbye
    try:
        info = pair[0].next_rendezvous()
        assert info.world_size == 1 and pair[0]._state_holder.state.round == 1
    finally:
        close(pair)


def test_a_peer_that_breaks_the_round_wakes_a_running_agent_at_once(store):
    """Node 1's workers failed: its join of the next round writes round 0 broken, and node
    0's agent, running its workers, hears of it from the store (``on_change``) instead of
    its next poll; a ``refresh`` then reads the broken round, and both form round 1."""
    a_broken_round_wakes_a_running_agent([agent(store, "push", ours=True) for _ in range(2)])


def a_broken_round_wakes_a_running_agent(pair) -> None:
    """The check of the test above, for any backend that pushes its changes (the etcd v3
    one's test too); closes ``pair``."""
    try:
        assert join_all(pair, [0.0, 0.0]) == [2, 2]
        running, failing = pair
        assert not running.round_broken()
        heard = threading.Event()
        assert running.on_change(heard.set)
        failing.group_failed()
        rejoin = threading.Thread(target=lambda: setattr(rejoin, "info", failing.next_rendezvous()))
        rejoin.start()
        for _ in range(5):  # a change of round 0's forming may still be on its way: heard first
            assert heard.wait(20)
            heard.clear()
            running.refresh()
            if running.round_broken():
                break
        assert running.round_broken()
        info = running.next_rendezvous()
        rejoin.join(30)
        assert info.world_size == 2 and rejoin.info.world_size == 2
    finally:
        close(pair)


def test_a_waiting_agent_sees_its_round_complete_when_it_is_written(store, monkeypatch):
    """A join's poll is a wait for the next change (``delay`` -> ``wait_for_change``), not a
    sleep: with the poll made 60 s long, two agents still form their group."""
    a_waiting_agent_is_woken_by_the_round_it_waits_for(lambda: agent(store, "wake", ours=True), monkeypatch)


def a_waiting_agent_is_woken_by_the_round_it_waits_for(make_agent, monkeypatch) -> None:
    """The check of the test above, for any backend that pushes its changes."""
    from elastic_harness.rendezvous import handler as rendezvous

    monkeypatch.setattr(rendezvous, "POLL_S", 60.0)
    monkeypatch.setattr(rendezvous, "TORCH_DELAY",  # the start-up skew (a range) stays torch's sleep
                        lambda s: None if isinstance(s, tuple) else pytest.fail(f"slept {s} s, not waited"))
    pair = [make_agent() for _ in range(2)]
    try:
        for h in pair:
            rendezvous.rdzv.set_state_cache(h, 60.0)
        assert join_all(pair, [0.0, 0.0]) == [2, 2]
    finally:
        close(pair)


def test_event_names_match_torchs_without_inspecting_the_stack():
    """Each rendezvous event is named after the method that recorded it: ``method_name``
    gives what torch's ``get_method_name`` gives, called the way torch's ``_record`` does."""
    from elastic_harness.rendezvous.handler import TORCH_METHOD_NAME as torch_own
    from elastic_harness.rendezvous.handler import method_name

    class Executor:
        def _record(self, lookup):
            return lookup()

        def _add_to_participants(self, lookup):
            return self._record(lookup)

    names = [Executor()._add_to_participants(f) for f in (torch_own, method_name)]
    assert names == ["_add_to_participants"] * 2
    assert method_name(10_000) == torch_own(10_000) == "no_method_name"


def test_rendezvous_events_match_torchs_own(monkeypatch):
    """``record_event`` records what torch's ``construct_and_record_rdzv_event`` records
    (the caller's file and method name, the fields, the error trace of a failure)."""
    import json
    import logging

    from torch.distributed.elastic.events import (
        NodeState,
        construct_and_record_rdzv_event,
        handlers,
    )

    from elastic_harness.rendezvous.handler import record_event

    seen: list[dict] = []

    class Capture(logging.Handler):
        def emit(self, record):
            seen.append(json.loads(record.getMessage()))

    monkeypatch.setitem(handlers._log_handlers, "dynamic_rendezvous", Capture())

    class Executor:
        def _add_to_participants(self, record, state):
            record(run_id="r", message="m", node_state=state, hostname="h", pid=7, local_id=1, rank=0)

        def _fail(self, record):
            try:
                raise ValueError("boom")
            except ValueError:
                record(run_id="r", message="f", node_state=NodeState.FAILED, name="n", hostname="h", pid=7)

    for fn in (construct_and_record_rdzv_event, record_event):
        Executor()._add_to_participants(fn, NodeState.RUNNING)
        Executor()._fail(fn)
    for e in seen:
        e.pop("timestamp", None)  # recorded when each was made
    torch_events, ours = seen[:2], seen[2:]
    assert ours == torch_events
    assert torch_events[0]["name"] == "test_rendezvous.py:_add_to_participants"
    assert "ValueError: boom" in torch_events[1]["error_trace"]


def test_only_an_end_that_ends_the_job_closes_its_rendezvous():
    """Closing the rendezvous ends every node's part. A finished job, a spent restart budget
    or an agent's own error close it; a signalled agent, a node kept out, or an agent that
    lost its connection to the store leave it open for the others."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousConnectionError,
        RendezvousTimeoutError,
    )

    from elastic_harness.agent.elastic import GroupLeft, closes_rendezvous

    failed = ChildFailedError("worker", {0: ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file="")})
    assert closes_rendezvous(None, excluded=False)
    assert closes_rendezvous(failed, excluded=False)
    assert not closes_rendezvous(failed, excluded=True)
    # in place: a group left for a peer's fault with every worker alive, then kept out
    assert not closes_rendezvous(GroupLeft("left"), excluded=True)
    assert closes_rendezvous(GroupLeft("left"), excluded=False)
    assert closes_rendezvous(RuntimeError("a bug"), excluded=False)
    assert closes_rendezvous(RendezvousTimeoutError("too few nodes"), excluded=False)
    assert not closes_rendezvous(SignalException("SIGTERM", 15), excluded=False)
    assert not closes_rendezvous(RendezvousConnectionError("etcd gone"), excluded=False)


def test_a_file_store_has_no_change_signal_and_its_join_sleeps_as_torchs(tmp_path, monkeypatch):
    """A file store cannot push a change: its backend says so (None, at once) and the
    handler's poll is torch's sleep of the poll interval, decided in the handler only."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from elastic_harness.rendezvous import handler as rendezvous

    slept: list = []
    monkeypatch.setattr(rendezvous, "TORCH_DELAY", slept.append)
    params = RendezvousParameters("c10d", str(tmp_path / "store"), "file-poll", 1, 2, store_type="file",
                                  join_timeout=30, read_timeout=30)
    h = create_handler(params, key=TEST_KEY)
    try:
        backend = rendezvous.rdzv.state_backend(h)
        assert backend.changes is None
        assert backend.wait_for_change(30.0) is None  # no 30 s block
        h.wait_for_change(0.25)
        assert slept == [0.25]
    finally:
        h.shutdown()
