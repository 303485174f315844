"""Progress watchdog on torchelastic's file-based timer.

The agent runs a ``FileTimerServer`` (``launch.watchdog``) and workers find its FIFO in
``TORCHELASTIC_TIMER_FILE``. The loop re-arms one countdown at the start of every step
(and with a longer budget before a blocking save); if a worker stops making progress, frozen
by SIGSTOP, deadlocked anywhere in the loop, or stuck in a collective with a frozen peer,
the server SIGKILLs it and the agent restarts the group: seconds, not gloo's 30 minutes.
Without a timer file, or with a timeout of 0, it does nothing.

Re-arming is a FIFO open, a JSON line and a close in the worker, and a read and a parse in
the agent: every step of a fast loop, that was work both processes did ten times a second
for nothing (``bench throughput``). So a plain re-arm (``extra_s`` 0) within ``slack_s`` of
the last one sent is not sent; each one that is sent asks for ``timeout + slack`` seconds.
The deadline the server holds is then never earlier than ``timeout`` after the last
progress (a step may still take the whole timeout), and a stuck worker is killed at most
``slack_s`` later than with a re-arm at every step (``resend_due``).
"""

from __future__ import annotations

import time

SCOPE = "elastic-harness-progress"
SLACK_SHARE = 0.1  # of the timeout: a stuck worker is found at most this much later
MAX_SLACK_S = 1.0


def slack_of(timeout_s: float) -> float:
    """Pure: how long a sent deadline covers further re-arms (0 for no timeout)."""
    return min(MAX_SLACK_S, SLACK_SHARE * timeout_s) if timeout_s > 0 else 0.0


def resend_due(now: float, last_sent: float | None, last_extra: float, extra_s: float, slack_s: float) -> bool:
    """Pure: send this re-arm? Always with an extra budget (a save) or after one (to take it
    back), the first time, and once ``slack_s`` has passed since the last one sent."""
    return extra_s > 0 or last_extra > 0 or last_sent is None or now - last_sent >= slack_s


class ProgressWatchdog:
    def __init__(self, timer_file: str, timeout_s: float, clock=time.time) -> None:
        self.timeout_s = timeout_s
        self.slack_s = slack_of(timeout_s)
        self._clock = clock
        self._client = None
        self._sent: float | None = None  # when the last deadline was sent (None: disarmed)
        self._extra = 0.0  # that deadline's extra budget
        if timer_file and timeout_s > 0:
            from torch.distributed.elastic.timer import FileTimerClient

            self._client = FileTimerClient(timer_file)

    def arm(self, extra_s: float = 0.0) -> None:
        """(Re)start the countdown: the worker must call ``arm`` again within the budget."""
        if self._client is None:
            return
        now = self._clock()
        if not resend_due(now, self._sent, self._extra, extra_s, self.slack_s):
            return
        self._client.acquire(SCOPE, now + self.timeout_s + self.slack_s + extra_s)
        self._sent, self._extra = now, extra_s

    def disarm(self) -> None:
        if self._client is not None:
            self._client.release(SCOPE)
            self._sent, self._extra = None, 0.0
