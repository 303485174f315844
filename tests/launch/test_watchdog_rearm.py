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
        self.stall: list[float] = []  # the stall deadline sent with each

    def send(self, progress: float, stall: float) -> None:
        self.sent.append(("acquire", progress))
        self.stall.append(stall)

    def release(self, scope: str) -> None:
        self.sent.append(("release", -1.0))
        self.stall.append(-1.0)


def watchdog(clock: list[float], timeout: float = 10.0) -> tuple[timer.ProgressWatchdog, FakeClient]:
    w = timer.ProgressWatchdog("", timeout, clock=lambda: clock[0])
    w._client = FakeClient()  # the FIFO's client: what was sent, and when
    return w, w._client


def test_rearms_within_the_slack_are_not_sent_and_the_deadline_covers_every_progress():
    clock = [100.0]
    w, client = watchdog(clock)
    w.durations = [3.0] * 10  # slow steps measured: a stall bound of 10 s (the timeout)
    assert w.slack_s == 1.0 and w.stall_bound() == 10.0
    progress = []
    for _ in range(100):  # 100 steps of 0.1 s
        w.arm()
        progress.append(clock[0])
        clock[0] += 0.1
        w.durations[:] = [3.0] * 10  # keep the bound where it is
    assert len(client.sent) == 10  # one a second, not one a step
    deadlines = [d for _, d in client.sent]
    for t in progress:  # the deadline in force at each progress point: the last sent before it
        held = max(d for d in deadlines if d - w.timeout_s - w.slack_s <= t + 1e-9)  # sent by then
        assert held >= t + w.timeout_s  # never kills a step that takes less than the timeout
        assert held <= t + w.timeout_s + w.slack_s + 1e-9  # found at most the slack later


def test_fast_steps_give_a_stall_bound_with_a_floor_that_every_deadline_covers():
    clock = [0.0]
    w, client = watchdog(clock)
    progress, sent_at = [], []
    for _ in range(200):  # 0.05 s steps: 5 x 0.05 is below the floor of 1 s
        before = len(client.sent)
        w.arm()
        if len(client.sent) > before:
            sent_at.append(clock[0])
        progress.append(clock[0])
        clock[0] += 0.05
    assert w.stall_bound() == timer.STALL_FLOOR_S
    assert client.stall[0] == pytest.approx(w.timeout_s + w.slack_s), "the first steps: the whole timeout"
    assert len(sent_at) <= 4 * progress[-1] + 2, "about four a second"
    for t in progress[timer.WARMUP_STEPS + 1:]:  # the deadlines in force at each progress point
        i = max(n for n, s in enumerate(sent_at) if s <= t + 1e-9)
        assert client.stall[i] >= t + timer.STALL_FLOOR_S, "never 'stalled' before the bound"
        assert client.sent[i][1] >= t + w.timeout_s, "never killed before the timeout"


@pytest.mark.parametrize(("durations", "bound"), [
    ([0.1] * 4, 60.0),  # too few measured: the first steps compile and warm up
    ([0.1] * 20, 1.0),  # fast steps: the floor
    ([2.0] * 20, 10.0),  # five times the usual step
    ([1.0] * 18 + [30.0, 30.0], 5.0),  # one slow step in ten is not the usual one
    ([20.0] * 20, 60.0),  # never beyond the timeout
])
def test_the_stall_bound_comes_from_measured_steps(durations, bound):
    assert timer.stall_bound_s(durations, 60.0) == bound


def test_steps_with_a_phase_in_them_are_not_measured():
    clock = [0.0]
    w, _ = watchdog(clock)
    for extra, then in [(0, 1.0), (0, 0.2), (30.0, 20.0), (0, 0.1), (0, 1.0), (0, 1.0)]:
        w.arm(extra_s=extra)
        clock[0] += then
    # measured: 1.0 (first to second arm), then the phase ends the measure; the arm after it
    # closes the phase, the next one starts a step again
    assert w.durations == [1.0, 1.0]


def test_a_save_budget_is_sent_and_taken_back_at_once_and_disarm_resets():
    clock = [0.0]
    w, client = watchdog(clock)
    w.arm()
    w.arm(extra_s=30.0)  # before a blocking save: always sent
    w.arm()  # right after it: sent, so the long budget does not linger
    assert [round(d, 3) for _, d in client.sent] == [11.0, 41.0, 11.0]
    w.disarm()
    w.arm()  # the first arm after a disarm is sent
    assert [k for k, _ in client.sent][-3:] == ["release", "release", "acquire"]


def test_no_timeout_no_slack():
    assert timer.slack_of(0) == 0.0
    assert timer.slack_of(4.0) == pytest.approx(0.4)
    assert not timer.ProgressWatchdog("", 0.0)._client


def test_a_bound_that_falls_is_sent_at_once():
    """Fast first steps: the bound drops from the timeout to the floor within one slack; the
    agent must not keep the warm-up's deadline."""
    clock = [0.0]
    w, client = watchdog(clock)
    for _ in range(timer.WARMUP_STEPS + 2):
        w.arm()
        clock[0] += 0.005
    assert w.stall_bound() == timer.STALL_FLOOR_S
    assert client.stall[-1] <= clock[0] + timer.STALL_FLOOR_S + 0.25


def test_a_saves_budget_is_measured_from_earlier_saves_and_renewed_by_progress():
    """Every save used to get the process group's whole timeout (issue 42: a worker frozen
    inside one outlived its healthy peer's collective). Now the first save of a kind gets it,
    later ones five times the longest recent save (at least the floor), and progress inside
    a save renews that budget, not the process group's."""
    assert timer.save_budget_s([], cap_s=120.0) == 120.0, "the first save makes its plan: slow"
    assert timer.save_budget_s([0.2, 0.5], cap_s=120.0) == timer.SAVE_FLOOR_S
    assert timer.save_budget_s([4.0], cap_s=120.0) == 20.0
    assert timer.save_budget_s([60.0], cap_s=120.0) == 120.0
    clock = [0.0]
    w, client = watchdog(clock)
    w.renew_s = 120.0
    with w.save("async"):
        clock[0] += 0.3
    assert client.sent[-2][1] == 0.0 + 10.0 + 1.0 + 120.0, "the first save: the whole timeout"
    with w.save("async"):
        sent_at_start = client.sent[-1][1]
        clock[0] += 2.0
        w.renew()  # bytes moved
        renewed = client.sent[-1][1]
    assert sent_at_start == 0.3 + 10.0 + 1.0 + timer.SAVE_FLOOR_S
    assert renewed == 2.3 + 10.0 + 1.0 + timer.SAVE_FLOOR_S
    w.renew()  # outside a save (a restore before the loop): the renew budget
    assert client.sent[-1][1] == clock[0] + 10.0 + 1.0 + 120.0
