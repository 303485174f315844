"""Progress watchdog on torchelastic's file-based timer.

The agent runs a ``FileTimerServer`` (``launch.watchdog``) and workers find its FIFO in
``TORCHELASTIC_TIMER_FILE``. The loop re-arms one countdown at the start of every step
(and with a longer budget before a blocking save); if a worker stops making progress, frozen
by SIGSTOP, deadlocked anywhere in the loop, or stuck in a collective with a frozen peer,
the server SIGKILLs it and the agent restarts the group: seconds, not gloo's 30 minutes.
Without a timer file, or with a timeout of 0, it does nothing.
"""

from __future__ import annotations

import time

SCOPE = "elastic-harness-progress"


class ProgressWatchdog:
    def __init__(self, timer_file: str, timeout_s: float, clock=time.time) -> None:
        self.timeout_s = timeout_s
        self._clock = clock
        self._client = None
        if timer_file and timeout_s > 0:
            from torch.distributed.elastic.timer import FileTimerClient

            self._client = FileTimerClient(timer_file)

    def arm(self, extra_s: float = 0.0) -> None:
        """(Re)start the countdown: the worker must call ``arm`` again within the budget."""
        if self._client is not None:
            self._client.acquire(SCOPE, self._clock() + self.timeout_s + extra_s)

    def disarm(self) -> None:
        if self._client is not None:
            self._client.release(SCOPE)
