"""``runtime.timer.ProgressWatchdog``: a plain re-arm within the slack of the last one sent is
not sent, and the deadline the server holds never comes before ``timeout`` after the last
progress (a step may still take the whole timeout)."""

from __future__ import annotations

import pytest

from elastic_harness.runtime import timer

pytestmark = pytest.mark.timeout(30)


class FakeClient:
    def __init__(self) -> None:
        self.sent: list[tuple[str, float]] = []

    def acquire(self, scope: str, deadline: float) -> None:
        self.sent.append(("acquire", deadline))

    def release(self, scope: str) -> None:
        self.sent.append(("release", -1.0))


def watchdog(clock: list[float], timeout: float = 10.0) -> tuple[timer.ProgressWatchdog, FakeClient]:
    w = timer.ProgressWatchdog("", timeout, clock=lambda: clock[0])
    w._client = FakeClient()  # the FIFO's client: what was sent, and when
    return w, w._client


def test_rearms_within_the_slack_are_not_sent_and_the_deadline_covers_every_progress():
    clock = [100.0]
    w, client = watchdog(clock)
    assert w.slack_s == 1.0
    progress = []
    for _ in range(100):  # 100 steps of 0.1 s
        w.arm()
        progress.append(clock[0])
        clock[0] += 0.1
    assert len(client.sent) == 10  # one a second, not one a step
    deadlines = [d for _, d in client.sent]
    for t in progress:  # the deadline in force at each progress point: the last sent before it
        held = max(d for d in deadlines if d - w.timeout_s - w.slack_s <= t + 1e-9)  # sent by then
        assert held >= t + w.timeout_s  # never kills a step that takes less than the timeout
        assert held <= t + w.timeout_s + w.slack_s + 1e-9  # found at most the slack later


def test_a_save_budget_is_sent_and_taken_back_at_once_and_disarm_resets():
    clock = [0.0]
    w, client = watchdog(clock)
    w.arm()
    w.arm(extra_s=30.0)  # before a blocking save: always sent
    w.arm()  # right after it: sent, so the long budget does not linger
    assert [round(d, 3) for _, d in client.sent] == [11.0, 41.0, 11.0]
    w.disarm()
    w.arm()  # the first arm after a disarm is sent
    assert [k for k, _ in client.sent][-2:] == ["release", "acquire"]


def test_no_timeout_no_slack():
    assert timer.slack_of(0) == 0.0
    assert timer.slack_of(4.0) == pytest.approx(0.4)
    assert not timer.ProgressWatchdog("", 0.0)._client
