"""Is a silent node gone? (``rendezvous.verdict``, issue 36 item 1): the pure verdict, the judge
that gathers its evidence, and the step watchdog that asks it (a real FIFO and worker)."""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime, timedelta, timezone

import pytest

from elastic_harness.agent.stall import StallJudge
from elastic_harness.rendezvous import verdict
from elastic_harness.rendezvous.verdict import ALIVE, GONE, SILENT, Peer

pytestmark = pytest.mark.timeout(60)


def peer(node="b", listed=True, silent_s=3.0, bound_s=2.0) -> Peer:
    return Peer(node, listed, silent_s, bound_s)


def test_a_silent_peer_whose_beacon_is_silent_is_gone_while_the_group_stalls():
    found = verdict.judge(stalled_s=1.5, stall_bound_s=1.0, peers=[peer(), peer("c", silent_s=0.4)],
                          answers={"b": SILENT})
    assert found.gone == {"b"} and found.broken and "no keep-alive for 3.0s" in found.reason


@pytest.mark.parametrize(("kw", "why"), [
    ({"stalled_s": 0.5}, "the group still makes progress: a peer's silence alone is never enough"),
    ({"answers": {"b": ALIVE}}, "its agent answers: late keep-alives, but alive (a slow node)"),
    ({"answers": {}}, "nobody asked its beacon (it has none): only torch's expiry drops it"),
    ({"peers": [peer(silent_s=1.9)]}, "silent, but not past its bound"),
    ({"peers": [peer(silent_s=None)]}, "no keep-alive listed: nothing to measure"),
])
def test_without_all_the_evidence_nobody_is_gone(kw, why):
    args = {"stalled_s": 1.5, "stall_bound_s": 1.0, "peers": [peer()], "answers": {"b": SILENT}, **kw}
    assert not verdict.judge(**args), why


def test_a_refused_beacon_is_gone_however_fresh_its_keep_alives():
    found = verdict.judge(stalled_s=2.0, stall_bound_s=1.0, peers=[peer(silent_s=0.1)], answers={"b": GONE})
    assert found.gone == {"b"} and "refused" in found.reason


def test_a_peer_that_left_the_round_breaks_a_stalled_group_without_dropping_anyone():
    found = verdict.judge(stalled_s=2.0, stall_bound_s=1.0, peers=[peer(listed=False)], answers={})
    assert found and found.gone == frozenset() and found.broken and "left the round" in found.reason
    assert not verdict.judge(stalled_s=0.2, stall_bound_s=1.0, peers=[peer(listed=False)], answers={})


def test_suspects_are_the_listed_peers_silent_past_their_bound():
    peers = [peer("a"), peer("b", silent_s=1.0), peer("c", listed=False), peer("d", silent_s=None)]
    assert verdict.suspects(peers) == ["a"]


def test_the_silence_bound_follows_the_peers_own_gaps_up_to_torchs_expiry():
    assert verdict.silence_bound_s(1.0, 0.0, 3.0) == 2.0  # two intervals
    assert verdict.silence_bound_s(1.0, 1.3, 3.0) == 2.6  # a busy agent's keep-alives run late
    assert verdict.silence_bound_s(1.0, 4.0, 3.0) == 3.0  # torch drops it there anyway


def test_keep_alive_gaps_are_measured_per_node_and_forgotten_with_it():
    t = datetime(2026, 1, 1, tzinfo=timezone.utc)
    gaps = verdict.KeepAliveGaps()
    gaps.observe({"a": t, "b": t})
    gaps.observe({"a": t, "b": t})  # read again, nothing new
    gaps.observe({"a": t + timedelta(seconds=1.1), "b": t + timedelta(seconds=1.8)})
    assert gaps.usual("a") == pytest.approx(1.1) and gaps.usual("b") == pytest.approx(1.8)
    gaps.observe({"a": t + timedelta(seconds=2.2)})  # b left the state
    assert gaps.usual("b") == 0.0 and gaps.usual("a") == pytest.approx(1.1)


class Handler:
    """What ``StallJudge`` reads of the rendezvous handler."""

    def __init__(self, peers, beacons) -> None:
        self.peers, self.beacons, self.condemned = peers, beacons, set()

    def peers_now(self):
        return self.peers, self.beacons

    def condemn(self, nodes) -> None:
        self.condemned |= set(nodes)


def test_the_judge_asks_only_suspects_beacons_and_condemns_the_gone():
    asked, now = [], [0.0]
    handler = Handler([peer("b"), peer("c", silent_s=0.3)], {"b": "10.0.0.2:1", "c": "10.0.0.3:1"})
    judge = StallJudge(handler, ask=lambda a: asked.append(a) or SILENT, clock=lambda: now[0])
    found = judge(1.5, 1.0)
    assert asked == ["10.0.0.2:1"] and found.gone == {"b"} and handler.condemned == {"b"}
    assert not judge(1.6, 1.0) and len(asked) == 1, "asked again only after every_s"
    now[0] = 1.0
    assert judge(1.6, 1.0).gone == {"b"}


def test_the_judge_says_nothing_before_any_round():
    class Fresh(Handler):
        def peers_now(self):
            return None

    assert not StallJudge(Fresh([], {}))(10.0, 1.0)


WORKER = """
import os, sys, time
from elastic_harness.runtime.timer import ProgressWatchdog
w = ProgressWatchdog(os.environ['TORCHELASTIC_TIMER_FILE'], float(sys.argv[1]))
for i in range(40):  # 0.8 s of quick steps: the bound is sent once they were measured
    w.arm(); time.sleep(0.02)
print(w.stall_bound(), flush=True)
time.sleep(60)  # stalled: blocked in a collective with a frozen peer
"""


def stalled_worker(tmp_path, timeout_s: float, judge):
    """A real worker process that measures 40 quick steps, then stalls; the agent's real
    step watchdog with ``judge``. Returns (exit code, stall bound, judge calls, reports)."""
    from elastic_harness.agent import watchdog

    server = watchdog.start("test", tmp_path)
    calls, reports = [], []
    server.judge = lambda stalled, bound: calls.append((stalled, bound)) or judge(stalled)
    server.on_verdict = lambda pid, s, found: reports.append(("verdict", found.gone))
    server.on_reap = lambda pid, s, state: reports.append(("hang", state))
    try:
        child = subprocess.Popen([sys.executable, "-c", WORKER, str(timeout_s)], stdout=subprocess.PIPE, text=True)
        bound = float(child.stdout.readline())
        code = child.wait(timeout=45)
    finally:
        server.stop()
    return code, bound, calls, reports


def test_a_stalled_worker_is_stopped_on_a_verdict_long_before_its_timeout(tmp_path):
    gone = verdict.Verdict(frozenset({"b"}), True, "b is gone")
    code, bound, calls, reports = stalled_worker(
        tmp_path, 30.0, lambda stalled: gone if stalled > 2.0 else verdict.Verdict())
    assert bound == 1.0 and code == -9
    assert reports == [("verdict", {"b"})]
    # asked once past the bound it sent (1 s and its slack, less the FIFO's delay), never before
    assert all(1.0 <= b <= 1.25 and stalled >= b for stalled, b in calls)


def test_a_stall_without_a_verdict_kills_only_at_the_timeout(tmp_path):
    code, bound, calls, reports = stalled_worker(tmp_path, 4.0, lambda stalled: verdict.Verdict())
    assert code == -9 and reports == [("hang", "S")], "a hang, as before: nobody was found gone"
    assert calls, "the agent asked while the worker stalled"
