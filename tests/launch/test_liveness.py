"""A dead node sooner (``rendezvous.liveness``, issue 26 item 5): the rule, and real rounds.

The rounds are torch's own handlers (ours, from ``create_handler``) in threads of this
process against a real c10d ``TCPStore``, as in ``test_rendezvous``. torch's keep-alive
expiry is set far beyond the join timeout here, so a survivor can only close a round alone
if the rule dropped its silent peer; every simulated agent of this process is the same
(live) process, so "gone" is told by giving a node the identity of a process that exited.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from datetime import datetime, timedelta, timezone

import pytest
from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.multiprocessing.api import ProcessFailure

from elastic_harness.agent.elastic import lost_a_peer
from elastic_harness.rendezvous import liveness
from elastic_harness.rendezvous.handler import create_handler
from elastic_harness.torchcompat.rdzv import StateView
from tests.launch.test_rendezvous import TEST_KEY, close, join_all, store  # noqa: F401 - fixture

pytestmark = pytest.mark.timeout(90)

GLOO_RESET = ("RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:61569: Connection "
              "reset by peer. This is typically caused by a remote worker hanging")


@pytest.mark.parametrize(("message", "lost"), [
    (GLOO_RESET, True),
    ("RuntimeError: [pair.cc:534] Connection closed by peer [10.0.0.2]:4242", True),
    ("OSError: [Errno 32] Broken pipe", True),
    # a frozen peer: the collective times out, which says nothing of the peer's process
    ("RuntimeError: [gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 30000ms", False),
    ("Signal 9 (SIGKILL) received by PID 1234", False),  # this node's own worker was killed
    ("ValueError: loss is nan", False),
])
def test_peer_lost_reads_the_failure_message(message, lost):
    assert liveness.peer_lost(message) is lost


def failed(*messages) -> RunResult:
    failures = {}
    for rank, message in enumerate(messages):
        f = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=1, error_file="<N/A>")
        f.message = message
        failures[rank] = f
    return RunResult(state=WorkerState.FAILED, failures=failures)


def test_the_agent_reads_torchelastics_failure_records():
    assert lost_a_peer(failed({"message": GLOO_RESET, "extraInfo": {"timestamp": "1"}}))
    assert lost_a_peer(failed("Signal 9 (SIGKILL) received by PID 1", GLOO_RESET))
    assert not lost_a_peer(failed("Signal 9 (SIGKILL) received by PID 1"))


def test_suspect_after_is_two_intervals_at_most_torchs_expiry():
    assert liveness.suspect_after_s(1.0, 3) == 2.0
    assert liveness.suspect_after_s(5.0, 1) == 5.0


NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


def decide(*, evidence=True, complete=True, round_=4, participants=("a", "b"), peers=("me", "a", "b"),
           verdicts=None, silent_s=None):
    verdicts = verdicts or {}
    silent_s = silent_s or {}
    beats = {n: NOW - timedelta(seconds=silent_s.get(n, 0.5)) for n in participants}
    state = StateView(round=round_, complete=complete, participants=dict.fromkeys(participants, 0),
                      last_heartbeats=beats)
    return liveness.dead_peers(state, my_round=4, peers=set(peers), me="me", evidence=evidence,
                               gone=lambda n: verdicts.get(n), stale=NOW - timedelta(seconds=2.0))


def test_a_gone_process_on_this_host_is_dropped_at_once():
    assert decide(verdicts={"a": True, "b": False}) == {"a"}


def test_a_live_process_on_this_host_is_never_dropped_however_silent():
    """A SIGSTOPped or overloaded agent is a live process: only torch's expiry drops it."""
    assert decide(verdicts={"a": False, "b": False}, silent_s={"a": 60, "b": 60}) == set()


def test_another_hosts_node_is_dropped_once_silent_two_intervals():
    assert decide(silent_s={"a": 2.5, "b": 1.5}) == {"a"}


@pytest.mark.parametrize("change", [
    {"evidence": False},  # no worker of ours lost a peer: silence alone is never enough
    {"complete": False},  # the round is no longer the one we were in together
    {"round_": 5},
    {"participants": ()},  # everyone left it (alive)
    {"peers": ("me",)},  # not a peer of our round: a node we know nothing about
])
def test_without_all_the_evidence_nobody_is_dropped(change):
    args = {"verdicts": {"a": True, "b": True}, "silent_s": {"a": 60, "b": 60}, **change}
    assert decide(**args) == set()


def test_this_node_never_drops_itself():
    assert decide(participants=("me",), verdicts={"me": True}, silent_s={"me": 60}) == set()


def exited_identity() -> str:
    """The identity of a process of this host that has exited (its pid is free now)."""
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                           text=True, check=True)
    boot, ns, _pid, _start = liveness.identity().split("/")
    return f"{boot}/{ns}/{int(child.stdout)}/1"


def test_identity_tells_a_live_process_from_an_exited_one():
    assert liveness.gone(liveness.identity()) is False
    assert liveness.gone(exited_identity()) is True
    assert liveness.gone("other-boot/1/2/3") is None, "another host: this one cannot tell"
    assert liveness.gone(None) is None
    boot, ns, _pid, _start = liveness.identity().split("/")
    assert liveness.gone(f"{boot}/{ns}/0/1") is None and liveness.gone(f"{boot}/{ns}/x/1") is None


def agent(endpoint: str, run_id: str, **overrides):
    """Ours, with torch's expiry (60 s) far beyond the join timeout (40 s)."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    conf = dict(join_timeout=40, last_call_timeout=1, close_timeout=10, heartbeat_timeout=5,
                keep_alive_interval=1, keep_alive_max_attempt=60, is_host=False, read_timeout=30,
                start_last_call_timeout=15)
    conf.update(overrides)
    return create_handler(RendezvousParameters("c10d", endpoint, run_id, 1, 2, **conf), key=TEST_KEY)


def formed_pair(endpoint: str, run_id: str, identity_of_1: str | None = None):
    pair = [agent(endpoint, run_id) for _ in range(2)]
    if identity_of_1 is not None:
        pair[1]._identity = identity_of_1  # what node 1 writes next to its keep-alives
    assert join_all(pair, [0.0, 0.0]) == [2, 2]
    return pair


def test_a_survivor_closes_the_round_alone_when_its_peer_is_gone(store):  # noqa: F811
    """Node 1's agent and workers are killed: node 0's workers lose their connection to it,
    and its agent's process is gone. Node 0 forms the next round alone, without waiting 60 s
    for node 1's keep-alives to expire."""
    pair = formed_pair(store, "gone", exited_identity())
    pair[1]._stop_heartbeats()  # killed: no more keep-alives, no goodbye
    try:
        pair[0].peer_lost()
        info = pair[0].next_rendezvous()
        assert info.world_size == 1 and pair[0]._state_holder.state.round == 1
    finally:
        close(pair)


def test_a_silent_peer_of_another_host_is_dropped_after_two_intervals(store):  # noqa: F811
    pair = formed_pair(store, "remote", "another-boot/1/2/3")
    pair[1]._stop_heartbeats()
    try:
        pair[0].peer_lost()
        assert pair[0].next_rendezvous().world_size == 1
    finally:
        close(pair)


def test_a_frozen_but_live_agent_is_not_dropped_and_rejoins(store):  # noqa: F811
    """Node 1's agent is alive (this process) but silent: even with node 0's workers having
    lost a peer, node 0 waits for it (torch's expiry, 60 s here). When node 1 comes back and
    restarts too, both form one group: no split."""
    pair = formed_pair(store, "frozen")
    pair[1]._stop_heartbeats()  # frozen: no keep-alives
    decided: list = []
    drop_dead = pair[0].drop_dead
    silent = threading.Event()

    def watch(state):  # node 0 decided again after node 1 was silent beyond two intervals
        dead = drop_dead(state)
        beat = state.last_heartbeats.get(pair[1]._this_node)
        if beat is not None and datetime.now(timezone.utc) - beat > timedelta(seconds=3):
            decided.append(dead)
            silent.set()
        return dead

    pair[0].drop_dead = watch
    pair[0].peer_lost()
    result: dict = {}
    survivor = threading.Thread(target=lambda: result.update(info=pair[0].next_rendezvous()))
    survivor.start()
    try:
        assert silent.wait(30), "node 0 never looked at the state with node 1 silent"
        assert not result and decided[-1] == frozenset(), "a live agent was dropped"
        assert pair[1].next_rendezvous().world_size == 2  # node 1 wakes up and restarts
        survivor.join(30)
        assert result["info"].world_size == 2
    finally:
        close(pair)


def test_a_workers_failure_event_says_when_it_lost_a_peer(tmp_path):
    from elastic_harness.events import EventLog, read_events
    from elastic_harness.runtime import failures

    log = EventLog(tmp_path / "events.jsonl")
    for exc in (RuntimeError(GLOO_RESET), ValueError("loss is nan")):
        try:
            raise exc
        except Exception as e:  # noqa: BLE001 - recorded as a worker records it
            failures.record(log, e, failures.Who(rank=0), step=3)
    lost = [e["peer_lost"] for e in read_events(tmp_path / "events.jsonl") if e["event"] == "failure"]
    assert lost == [True, False]


def exited(rank, pid, code, message=None):
    f = ProcessFailure(local_rank=rank, pid=pid, exitcode=code, error_file="<N/A>")
    if message is not None:  # it wrote its error file
        f.error_file, f.message = f"/errors/{rank}.json", {"message": message}
    return f


def test_a_failed_groups_account_says_the_cause_first():
    """Issue 33: the demo's failure line quoted the survivor's gloo error ("... GLHF!"),
    not that rank 1 was killed. The agent's account names the rank that died and how first;
    a survivor that only lost its peer comes after, whatever order the exits were seen in."""
    import io

    from elastic_harness.agent.elastic import exit_account
    from elastic_harness.commands.support.progress import Progress

    killed = exit_account({0: exited(0, 500, 1, GLOO_RESET), 1: exited(1, 501, -9)})
    assert killed["message"] == "rank 1 (pid 501) was killed by SIGKILL; then rank 0 lost its peers"
    assert (killed["rank"], killed["worker_pid"], killed["signal"], killed["exit_code"]) == (1, 501, "SIGKILL", -9)
    assert not killed["recorded"] and not killed["peer_lost"] and killed["cause"] == "exit"
    stopped = exit_account({1: exited(1, 501, -9), 0: exited(0, 500, -15)})
    assert stopped["message"] == "rank 1 (pid 501) was killed by SIGKILL; then rank 0 stopped (SIGTERM)"
    silent = exit_account({3: exited(3, 9, 7)})
    assert silent["message"] == "rank 3 (pid 9) exited with code 7 without recording an error"
    own = exit_account({0: exited(0, 5, 1, "ValueError: bad sample")})
    assert own["recorded"] and own["message"] == "rank 0 (pid 5) failed: ValueError: bad sample"
    elsewhere = exit_account({2: exited(2, 8, 1, GLOO_RESET)})  # a node whose peer died on another node
    assert elsewhere["peer_lost"] and elsewhere["message"].startswith("rank 2 (pid 8) lost its peers")

    out = io.StringIO()
    progress = Progress(40, out=out)
    for e in [{"t": 1.0, "event": "failure", "rank": 0, "peer_lost": True, "message": GLOO_RESET},  # a symptom
              {"t": 2.0, "event": "failure", **killed},
              {"t": 3.0, "event": "failure", "rank": 0, "message": "ValueError: bad sample", "peer_lost": False},
              {"t": 4.0, "event": "failure", **own},  # its rank's own line said it
              {"t": 5.0, "event": "failure", **elsewhere}]:
        progress.update(e)
    progress.close()  # a symptom whose cause nothing named is said by the end
    lines = out.getvalue().splitlines()
    assert [line.split(";")[0] for line in lines] == [
        "failure: rank 1 (pid 501) was killed by SIGKILL", "failure: ValueError: bad sample",
        f"failure: {elsewhere['message']}"]


def test_a_lost_node_is_one_line_and_its_survivors_symptom_only_when_nothing_named_the_cause():
    """Node 1 of 8 killed, agent and all: every survivor's agent accounts "lost its peers"
    and several may drop the node; the terminal says the node is gone once, by its node
    number, and not the survivors' gloo error (it quoted "rank 0 lost its peers (RuntimeError:
    [.../gloo/transport/tcp/pair.cc:561] Connection closed by peer ...)" first). A loss whose
    cause nobody names by the time the job recovered (or ended) keeps the symptom, once."""
    import io

    from elastic_harness.agent.elastic import exit_account
    from elastic_harness.commands.support.progress import Progress

    survivor = exit_account({2: exited(2, 8, 1, GLOO_RESET)})
    drop = ("Dropping node '127.0.0.1_4301_0' from round 0 of the rendezvous 'r' without waiting for its "
            "keep-alives to expire: its agent's process is gone, and this node's workers lost their "
            "connection to a peer")
    events = [{"event": "workers", "pid": 4301, "node": "1", "state": "started"},
              {"event": "workers", "pid": 4302, "node": "2", "state": "started"},
              {"event": "failure", **survivor, "node": "2"},
              {"event": "torchelastic", "pid": 4302, "node": "2", "message": drop},
              {"event": "failure", **survivor, "node": "0"},
              {"event": "torchelastic", "pid": 4300, "node": "0", "message": drop},
              {"event": "resume", "message": "restored from memory at step 40"},
              {"event": "failure", **survivor, "node": "3"}]  # the next generation's loss: said again
    out = io.StringIO()
    progress = Progress(40, out=out)
    for e in events:
        progress.update(e)
    assert out.getvalue().splitlines() == [
        "node 1 is gone (its agent's process is gone, and this node's workers lost their connection to a peer)",
        "restored from memory at step 40"]
    progress.update({"event": "resume", "message": "restored from memory at step 44"})
    assert out.getvalue().splitlines()[-2:] == [f"failure: {survivor['message']}", "restored from memory at step 44"]
    # Nodes in pid namespaces of their own (``--separate-hosts``) may share an agent pid:
    # then torch's name for the node, not a wrong number.
    progress = Progress(40, out=(out := io.StringIO()))
    for e in [{"event": "workers", "pid": 7, "node": "1"}, {"event": "workers", "pid": 7, "node": "2"},
              {"event": "torchelastic", "pid": 9, "node": "0", "message": drop.replace("_4301_", "_7_")}]:
        progress.update(e)
    assert out.getvalue().startswith("node 127.0.0.1_7_0 is gone (")


def test_a_spare_says_when_it_is_ready_and_whose_place_it_took():
    """A spare took 22 s to be ready under load, and nothing on the terminal said when it
    was, nor when it took a lost node's place."""
    import io

    from elastic_harness.commands.support.progress import Progress

    drop = ("Dropping node '127.0.0.1_4301_0' from round 0 of the rendezvous 'r' without waiting for its "
            "keep-alives to expire: its agent's process is gone")
    waiting = "The node '127.0.0.1_4399_0' added itself to the redundancy list of round 1 of 'r'."
    events = [{"t": 10.0, "event": "workers", "pid": 4301, "node": "1", "state": "started"},
              {"t": 10.5, "event": "spares", "nodes": ["2"], "world_size": 2},
              {"t": 31.0, "event": "torchelastic", "pid": 4399, "node": "2", "message": waiting},
              {"t": 32.0, "event": "torchelastic", "pid": 4399, "node": "2", "message": waiting},
              {"t": 40.0, "event": "torchelastic", "pid": 4300, "node": "0", "message": drop},
              {"t": 40.2, "event": "worker", "pid": 5, "node": "2", "rank": 1, "world_size": 2},
              {"t": 40.3, "event": "worker", "pid": 6, "node": "2", "rank": 1, "world_size": 2},
              {"t": 40.5, "event": "resume", "message": "restored from memory at step 40"}]
    progress = Progress(40, out=(out := io.StringIO()))
    for e in events:
        progress.update(e)
    assert out.getvalue().splitlines() == [
        "spare node 2 is ready (20.5 s after it was started): it takes the place of the next node lost",
        "node 1 is gone (its agent's process is gone)",
        "spare node 2 took node 1's place (world size 2)",
        "restored from memory at step 40"]


def test_a_step_timeout_below_the_step_time_is_said_once_and_a_timeout_waits_for_its_cause():
    """timeouts.step=0.01 printed six "hung ... after step 0" lines (one said 0s of silence
    against a 0.01 s bound) and no word that the bound is below the measured step time."""
    import io

    from elastic_harness.agent.elastic import exit_account
    from elastic_harness.agent.node import hang_message
    from elastic_harness.commands.support.progress import Progress

    assert "no progress for 0.01s after step 0" in hang_message("rank 0", 0, 0.0006, 0.01), "never less than the bound"
    progress = Progress(40, out=(out := io.StringIO()), step_timeout=0.01)
    for step in (1, 2):
        progress.update({"t": float(step), "event": "step", "step": step, "step_s": 0.032, "loss": 1.0})
    (warning,) = [line for line in out.getvalue().splitlines() if line.startswith("warning:")]
    assert "timeouts.step=0.01s is below the measured step time (0.032s at step 1)" in warning
    assert "0 turns the watchdog off" in warning
    quiet = Progress(40, out=(fine := io.StringIO()), step_timeout=60)
    quiet.update({"t": 1.0, "event": "step", "step": 1, "step_s": 0.032, "loss": 1.0})
    assert "warning" not in fine.getvalue()

    timeout = "RuntimeError: [/x/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv"
    account = exit_account({0: exited(0, 500, 1, timeout), 1: exited(1, 501, -9)}, stopped={1: (501, "T")})
    assert account["message"] == ("rank 1 (pid 501) hung (it was stopped by a signal): its peers waited on it; "
                                  "then rank 0 timed out waiting")
    assert (account["rank"], account["recorded"], account["peer_lost"]) == (1, False, False)
    progress = Progress(40, out=(seen := io.StringIO()))
    progress.update({"t": 1.0, "event": "failure", "rank": 0, "message": timeout, "peer_lost": False})
    progress.update({"t": 2.0, "event": "failure", **account})
    progress.update({"t": 3.0, "event": "resume", "message": "restored from memory at step 5"})
    assert seen.getvalue().splitlines() == [f"failure: {account['message']}", "restored from memory at step 5"]
