"""Progress watchdog on torchelastic's file-based timer.

The agent runs a ``FileTimerServer`` (``agent.watchdog``) and workers find its FIFO in
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

A checkpoint save is a phase whose budget is measured too (``save``, ``save_budget_s``): five
times the longest recent save of its kind, at least ``SAVE_FLOOR_S``, renewed while its bytes
move (``renew``); only the first save of a process gets the process group's whole timeout.
With that timeout as every save's budget, a worker frozen inside a save outlived
its healthy peer's collective (gloo's timeout, 120 s), and the peer was blamed.

Each re-arm also sends a second deadline, ``STALL_SCOPE``, with no signal (torch's own
server ignores it): the worker's *stall bound* (``stall_bound_s``: five times the 90th
percentile of the recent steps, at least ``STALL_FLOOR_S``; the whole timeout until
``WARMUP_STEPS`` were measured, while the first steps compile and caches warm). Past it the
agent stops nobody by itself: it looks for evidence that a peer node is gone (its
keep-alives and beacon: ``agent.watchdog``, ``rendezvous.verdict``), and stops the worker on
that evidence; the timeout stays the bound of a hang. Where steps legitimately stop, the
worker announces it with a longer budget for the timeout (``arm(extra_s)``, ``phase``):
saves and checkpoint I/O, evaluation, data loading that reports progress, and
``Run.phase`` in a script. A step with such a phase in it is not measured. Both deadlines
go in one write to the FIFO.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence

SCOPE = "elastic-harness-progress"
STALL_SCOPE = "elastic-harness-stall"  # no signal: the agent asks for evidence (module doc)
SLACK_SHARE = 0.1  # of the timeout: a stuck worker is found at most this much later
STALL_SLACK_SHARE = 0.25  # of a stall bound (re-arms four times a bound at most)
MAX_SLACK_S = 1.0
WARMUP_STEPS = 5  # steps measured before a stall bound replaces the timeout
STALL_STEPS_KEPT = 50
STALL_FACTOR = 5.0
STALL_FLOOR_S = 1.0
SAVE_FACTOR = 5.0  # a save's budget: this many times the longest recent save of its kind
SAVE_FLOOR_S = 10.0
SAVES_KEPT = 20


def slack_of(timeout_s: float, share: float = SLACK_SHARE) -> float:
    """Pure: how long a sent deadline covers further re-arms (0 for no timeout)."""
    return min(MAX_SLACK_S, share * timeout_s) if timeout_s > 0 else 0.0


def stall_bound_s(durations: Sequence[float], timeout_s: float, floor_s: float = STALL_FLOOR_S) -> float:
    """Pure: seconds a step may take before it counts as stalled: ``STALL_FACTOR`` times
    the 90th percentile of the measured ``durations``, at least ``floor_s``, at most
    ``timeout_s`` (which it is until ``WARMUP_STEPS`` were measured; 0: no timeout)."""
    if timeout_s <= 0 or len(durations) < WARMUP_STEPS:
        return timeout_s
    ordered = sorted(durations)
    p90 = ordered[int(0.9 * (len(ordered) - 1))]
    return min(timeout_s, max(floor_s, STALL_FACTOR * p90))


def save_budget_s(durations: Sequence[float], cap_s: float, floor_s: float = SAVE_FLOOR_S) -> float:
    """Pure: seconds a checkpoint save may take beyond the step timeout without progress:
    ``SAVE_FACTOR`` times the longest of the recent saves of its kind (``durations``), at
    least ``floor_s``, at most ``cap_s`` (``timeouts.process_group``), which is also the
    budget of the first (nothing measured yet: its plan is made then, and it is slow)."""
    if not durations:
        return cap_s
    return min(cap_s, max(floor_s, SAVE_FACTOR * max(durations)))


def resend_due(now: float, last_sent: float | None, last_extra: float, extra_s: float, slack_s: float) -> bool:
    """Pure: send this re-arm? Always with an extra budget (a save) or after one (to take it
    back), the first time, and once ``slack_s`` has passed since the last one sent."""
    return extra_s > 0 or last_extra > 0 or last_sent is None or now - last_sent >= slack_s


class ProgressWatchdog:
    def __init__(self, timer_file: str, timeout_s: float, clock=time.time, renew_s: float = 0.0) -> None:
        self.timeout_s = timeout_s
        self.renew_s = renew_s  # ``renew``'s budget outside a phase, and a first save's (``save``)
        self._saves: dict[str, list[float]] = {}  # recent saves' durations, by kind (``save``)
        self.slack_s = slack_of(timeout_s)
        self._clock = clock
        self._client = None
        self._sent: float | None = None  # when the last deadline was sent (None: disarmed)
        self._extra = 0.0  # that deadline's extra budget
        self._stall = float("inf")  # the stall deadline sent last
        self.durations: list[float] = []  # recent steps: between plain re-arms, no phase in them
        self._base: float | None = None  # the plain re-arm a step is measured from
        self._closing = False  # the next plain re-arm ends a phase: not a step's start
        if timer_file and timeout_s > 0:
            self._client = _client(timer_file)

    def arm(self, extra_s: float = 0.0) -> None:
        """(Re)start the countdown: the worker must call ``arm`` again within the budget.
        ``extra_s``: a phase's budget beyond ``timeouts.step`` (save, load, evaluation)."""
        if self._client is None:
            return
        now = self._clock()
        self._measure(now, extra_s)
        bound = self.stall_bound()
        stall_slack = slack_of(bound, STALL_SLACK_SHARE)
        stall = now + bound + stall_slack
        shorter = stall < self._stall - stall_slack  # the bound fell (the first steps measured)
        if not (shorter or resend_due(now, self._sent, self._extra, extra_s, min(self.slack_s, stall_slack))):
            return
        self._client.send(now + self.timeout_s + self.slack_s + extra_s, stall)
        self._sent, self._extra, self._stall = now, extra_s, stall

    def stall_bound(self) -> float:
        return stall_bound_s(self.durations, self.timeout_s)

    def _measure(self, now: float, extra_s: float) -> None:
        """A step is the time between two plain re-arms with no phase between them."""
        if extra_s > 0:
            self._base, self._closing = None, True
        elif self._closing:
            self._closing = False
        else:
            if self._base is not None:
                self.durations.append(now - self._base)
                del self.durations[:-STALL_STEPS_KEPT]
            self._base = now

    @contextlib.contextmanager
    def phase(self, budget_s: float) -> Iterator[None]:
        """Steps stop for up to ``budget_s`` (beyond ``timeouts.step``) inside this block;
        ``arm(extra_s=budget_s)`` inside it again to report progress."""
        self.arm(extra_s=budget_s)
        try:
            yield
        finally:
            self.arm()

    def renew(self) -> None:
        """Bytes moved (checkpoint I/O): the budget of the phase under way again from now,
        or ``renew_s`` outside one (a restore before the loop). A worker frozen inside the
        phase is then killed one budget after its last progress, not a process group's
        timeout after it: that timeout ended its healthy peer first, which was blamed."""
        self.arm(extra_s=self._extra if self._extra > 0 else self.renew_s)

    @contextlib.contextmanager
    def save(self, kind: str) -> Iterator[None]:
        """A checkpoint save of ``kind`` ("blocking", "async") inside this block: the step
        timeout plus ``save_budget_s`` of the saves of that kind measured before, renewed
        while bytes move (``renew``); the block's time is measured for the next."""
        kept = self._saves.setdefault(kind, [])
        t0 = self._clock()
        self.arm(extra_s=save_budget_s(kept, self.renew_s))
        try:
            yield
        finally:
            kept.append(self._clock() - t0)
            del kept[:-SAVES_KEPT]
            self.arm()

    def disarm(self) -> None:
        if self._client is not None:
            self._client.release(SCOPE)
            self._client.release(STALL_SCOPE)
            self._sent, self._extra, self._stall = None, 0.0, float("inf")
            self._base, self._closing = None, False


def _client(timer_file: str):
    """torch's ``FileTimerClient`` that sends both deadlines in one write (each line one
    request, as its server reads them; together far below the atomic ``PIPE_BUF``)."""
    import json
    import os
    import signal

    from torch.distributed.elastic.timer import FileTimerClient

    class Client(FileTimerClient):
        def send(self, progress: float, stall: float) -> None:
            pid = os.getpid()
            lines = "".join(json.dumps({"version": 1, "pid": pid, "scope_id": scope, "expiration_time": t,
                                        "signal": sig}) + "\n"
                            for scope, t, sig in ((SCOPE, progress, int(signal.SIGKILL)), (STALL_SCOPE, stall, 0)))
            try:  # as torch's client opens the FIFO: non-blocking, so a missing server raises
                file = os.fdopen(os.open(timer_file, os.O_WRONLY | os.O_NONBLOCK), "wt")
            except Exception as e:
                raise BrokenPipeError("the agent's step watchdog is not available") from e
            with file:
                file.write(lines)

    return Client(timer_file)
