"""torchelastic's agent, with the three behaviours we need changed, and a launcher for it.

``HarnessAgent`` is torchelastic's ``LocalElasticAgent`` (rendezvous, worker processes,
monitoring, restarts: all torch's) with three overrides, through ``torchcompat.agent``'s
``AgentBase`` (torch's underscored hooks and state under public names):

- ``stop_workers``: torch stops the worker group for a restart or a membership change
  with a fixed 30 s grace; a drain that saves a large state needs
  ``timeouts.shutdown_grace`` (``AgentBase.shutdown_grace``, which the agent also uses when
  it is itself signalled). For a membership change (the group healthy)
  the workers first get ``JOIN_SIGNAL``, not SIGTERM: a drain for a join, which keeps the
  state in memory where that covers the next restore (``runtime.hook``).
- ``monitor_workers``: when the group failed, ask ``judge()`` (``launch.policy``: fatal
  error or crash loop?) and, if it gives a reason, spend no more restarts. Otherwise it
  settles the restart budget: torch's ``max_restarts`` counts every failure of the agent's
  life; here only failures without progress count (``policy.restarts_left`` over the job's
  highest completed step at each failure, from ``progress()``), and torch's counter is
  refilled accordingly (``policy.budget_refill``, which keeps torch's restart count, the
  attempt number, as it is) or emptied with ``exhausted`` saying why. It also notes when it
  last ran, so ``health()`` can tell a live agent from a stuck one. When the group failed
  it tells the rendezvous handler (``group_failed``: the round is written broken, so every
  peer stops its group at once), and when a worker failed because a peer's connection
  closed, that too (``peer_lost``: ``rendezvous.liveness``), before torch restarts the group.
  A group still running in a round a peer wrote broken is stopped (SIGKILL: its workers
  may be blocked in a collective) instead of waiting for the failure to reach it through
  its collectives, peer by peer (node loss flat in the number of nodes); so is a
  drain for a join that is under way then. Between two passes it waits for news rather
  than sleeping (``await_news``): a worker's exit report from the zygote, or a ``nudge``
  from the rendezvous handler, ends the wait at once; torch's own loop only sleeps
  ``MONITOR_TICK_S``.
- ``start_workers``: the process context it makes stops a failed group's survivors within
  ``policy.failed_stop_grace`` (``bound_failure_close``), not torch's fixed 30 s. With a ``zygote`` (``agent.zygote``), the workers are forks of it
  instead of fresh interpreters. torch builds their environment and log files as usual and
  then calls its module-level ``start_processes``, which has no parameter for the kind of
  process context; for the duration of that call it is ``warm_processes`` instead
  (``torchcompat.agent.processes_from``; where a torch has no such function, workers start
  cold), which returns a ``WarmContext``.

A submission that lost its run directory's lock (``checkpoint.lock``: another live job took
it over while this one was frozen or cut off) stops: ``lock_lost`` is asked at each monitor
pass (the lock's heartbeat's last word) and before each worker generation starts (the lock
read then), and once it answers, the workers are killed without a save, no generation starts
(its restore would bump the generation fence and shut the holder's saves out), and the
agent ends with ``lost_lock`` (exit 2).

``report(state, restart)`` hears the worker group's phases, for the recovery breakdown:
``failed`` (a worker's exit was seen; warm starts only), ``stopped`` (the rest of the group
is gone; with cold starts also the first sign of a failure), ``started``.

``Launch`` does what ``torch.distributed.launcher.api.launch_agent`` does (rendezvous
parameters from the config, the worker spec, run, record torchelastic's own events, shut
the rendezvous down unless a signal ended the agent) with our agent class, which
``launch_agent`` does not let a caller choose, and the rendezvous handler of
``rendezvous.handler``. Dynamic rendezvous only (c10d, etcd): the
master address and port come from the rendezvous.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import select
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

from torch.distributed.elastic import events, metrics
from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec, WorkerState
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from elastic_harness.agent.keeper import Keeper
from elastic_harness.agent.warm import Keep, WarmContext, warm_invocation
from elastic_harness.agent.zygote import Zygote
from elastic_harness.errors import LockLost
from elastic_harness.launch.env import JOIN_SIGNAL
from elastic_harness.launch.policy import (
    agent_health,
    budget_refill,
    exhausted_message,
    failed_stop_grace,
    restarts_after_failure,
    restarts_left,
)
from elastic_harness.rendezvous import handler as rendezvous
from elastic_harness.rendezvous import liveness
from elastic_harness.torchcompat.agent import AgentBase, processes_from

log = logging.getLogger(__name__)
Report = Callable[..., None]  # (state, restart, **fields): a ``workers`` event

# torch's own sleep between two passes of its monitor loop (``WorkerSpec.monitor_interval``).
# The agent's interval (``timeouts.monitor_interval``) is waited out in ``monitor_workers``
# instead, where a worker's exit report from the zygote, or a ``nudge`` (the rendezvous
# handler: a peer's group failed), ends the wait at once (``HarnessAgent.await_news``).
MONITOR_TICK_S = 0.001
# What a worker takes for "drain, a node joins" (``runtime.session.Drain``); not imported
# from there: the agent does not import the worker side.


@dataclasses.dataclass(frozen=True)
class AgentSettings:
    """What the harness gives torch's agent beyond torch's own settings (``HarnessAgent``):
    ``judge()`` the reason to stop restarting (fatal error, crash loop) or None;
    ``quiet_bound_s`` how long the agent may go without a monitor pass and still be healthy;
    the ``zygote`` its workers fork from (None: cold starts); ``report(state, restart)`` hears
    the group's phases; ``progress()`` the job's highest completed step and
    ``restart_window`` the steps of progress that refill the restart budget; ``tick()`` runs
    at each monitor pass; ``on_failure(account)`` hears a failed group's ``exit_account``;
    ``in_place`` (``recovery: in_place``, warm starts only): a fault stops only what it broke
    (``agent.keeper``), and ``park_bound_s`` is how long a survivor may take to leave its
    step before it is stopped and forked anew instead."""

    judge: Callable[[], str | None]
    quiet_bound_s: float = 300.0
    zygote: Zygote | None = None
    report: Report | None = None
    progress: Callable[[], int] | None = None
    restart_window: int = 0
    tick: Callable[[], None] | None = None
    on_failure: Callable[[dict[str, Any]], None] | None = None
    in_place: bool = False
    park_bound_s: float = 60.0


class HarnessAgent(AgentBase):
    _failure_said = False  # the last failed group's account was said (``_account``)

    def __init__(self, *args: Any, settings: AgentSettings, monitor_interval: float | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        zygote = settings.zygote
        self.keeper = Keeper(zygote, settings.park_bound_s) if settings.in_place and zygote is not None else None
        # Seconds between looks at the workers when nothing happens (torch's spec holds its tick).
        self.monitor_interval = monitor_interval or self.worker_group.spec.monitor_interval
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._judge = settings.judge
        self._on_failure = settings.on_failure or (lambda account: None)  # hears ``exit_account`` of a failed group
        self._progress = settings.progress or (lambda: 0)
        self._tick = settings.tick or (lambda: None)  # each monitor pass: keeps the log reader current
        self._window = settings.restart_window
        self._budget = self.worker_group.spec.max_restarts  # the user's, before any refill
        self._failure_steps: list[int] = []
        self.exhausted: str | None = None  # why the restart budget ran out, when it did
        self.formed = False  # a rendezvous completed and workers were started
        self._quiet_bound_s = settings.quiet_bound_s
        self._last_monitor = time.monotonic()
        self._zygote = zygote
        self._report = settings.report or (lambda state, restart: None)
        self.stop_reason: str | None = None
        self._broken = False  # its group was stopped because a peer's failed (``_round_broken``)
        self.strikes: Any = None  # ``rendezvous.exclusion.Strikes`` of this node, when it may be kept out
        self.excluded: str | None = None  # why this node is kept out of the job, once it is
        self.on_excluded: Callable[[str], None] = lambda message: None
        self._node_name = ""
        # Why this submission no longer holds its run directory (``rundir.Claim.lost``; ``now``:
        # read the lock files first), set by the launcher; ``lost_lock`` once it found that.
        self.lock_lost: Callable[[bool], str] = lambda now: ""
        self.lost_lock = ""

    def nudge(self) -> None:
        """End the current wait between monitor passes now (any thread; never blocks): the
        rendezvous changed in a way that may concern the running group."""
        with contextlib.suppress(BlockingIOError, OSError):  # a nudge already pending is enough
            os.write(self._wake_w, b"!")

    def await_news(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for something to look at: an exit report from the zygote
        (when it runs this group's workers) or a ``nudge``; whether a nudge came. torch's
        loop sleeps a fixed monitor interval between passes; a worker that exited just after
        one pass was noticed half an interval later on average, on every node a failure
        reaches."""
        fds = [self._wake_r]
        if self._zygote is not None and isinstance(self.pcontext, WarmContext):
            fd = self._zygote.fileno()
            if fd is not None:
                fds.append(fd)
        if self.keeper is not None:
            fds.extend(self.keeper.fds())
        ready, _, _ = select.select(fds, [], [], max(0.0, timeout))
        if self._wake_r not in ready:
            return False
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._wake_r, 64):
                pass
        return True

    def health(self) -> tuple[bool, str]:
        """For the agent endpoint's ``/healthz`` (any thread; reads two fields, never blocks)."""
        state = self.worker_group.state.name
        return agent_health(state, time.monotonic() - self._last_monitor, self._quiet_bound_s)

    def _phase(self, state: str, **fields: Any) -> None:
        self._report(state, self.worker_group.spec.max_restarts - self.remaining_restarts, **fields)

    def start_workers(self, worker_group: Any) -> dict[int, int]:
        self.lost_lock = self.lost_lock or self.lock_lost(True)
        if self.lost_lock:  # a new generation would bump the fence and shut the lock's holder out
            raise LockLost(self.lost_lock)
        if self._zygote is None:
            pids = super().start_workers(worker_group)
        else:
            with _processes_from(self._zygote, self._phase, self.keeper.keep if self.keeper else None):
                pids = super().start_workers(worker_group)
            if self.keeper is not None:
                self.keeper.started()
        self.formed = True
        self._broken = False
        if self.pcontext is not None:
            bound_failure_close(self.pcontext, failed_stop_grace(self.shutdown_grace))
        adopted = getattr(self.pcontext, "adopted", {})
        if adopted:  # in place: which workers kept their process, which were started anew
            self._phase("started", kept=sorted(adopted.values()),
                        forked=sorted(set(pids.values()) - set(adopted.values())))
        else:
            self._phase("started")
        return pids

    def rank_of(self, pid: int) -> int | None:
        """The global rank of this agent's worker ``pid`` (None if it is not one of them)."""
        pids = self.pcontext.pids() if self.pcontext is not None else {}
        for worker in self.worker_group.workers:
            if pids.get(worker.local_rank) == pid:
                return worker.global_rank
        return None

    def _stopped_workers(self) -> dict[int, tuple[int, str]]:
        """This agent's workers that had not exited when their group failed but were found
        stopped (a signal, a tracer, uninterruptible sleep; ``WarmContext.stopped``, read
        before the group was closed, which then killed them): {global rank: (pid, /proc
        state)}. The cause of a group whose collectives timed out waiting on them, with the
        step watchdog off too."""
        found = getattr(self.pcontext, "stopped", None) or {}
        if not found and self.keeper is not None and isinstance(self.pcontext, WarmContext):
            # in place: still running; only a stopped one is the cause (D-state passes: a
            # new worker's imports read the disk)
            found = {lr: h for lr, h in self.pcontext.hung().items() if h[1] in ("T", "t")}
        ranks = {w.local_rank: w.global_rank for w in self.worker_group.workers}
        return {ranks[lr]: hung for lr, hung in found.items() if lr in ranks}

    def stop_workers(self, worker_group: Any) -> None:
        joins_in_place = self.keeper is not None and self.keeper.applies(self.pcontext, 1, self.stop_reason is not None)
        if worker_group.state == WorkerState.HEALTHY and joins_in_place:
            # In place: the join signal makes the workers park at their next step's end (after
            # its drain snapshot) instead of exiting; the parked ones go on into the next group.
            signal_workers(self.pcontext, JOIN_SIGNAL)
            if not self.keeper.keep_survivors(self.pcontext, bound_s=self.shutdown_grace):
                self._phase("unparked")
            super().shutdown(timeout=self.shutdown_grace)
            return
        if worker_group.state == WorkerState.HEALTHY:
            # torch stops a healthy group only for a membership change (a node waits to
            # join): the workers drain for a join, which may keep their state in memory.
            self._drain_for_join(self.shutdown_grace)
        elif self.keeper is not None and self.keeper.restart_follows:
            kept_all = self.keeper.keep_survivors(self.pcontext)
            self._say_late_exits()
            if not kept_all:
                self._phase("unparked")
            super().shutdown(timeout=self.shutdown_grace)  # the kept workers are no longer in it
            return
        self.shutdown(timeout=self.shutdown_grace)

    def shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: float | None = None) -> None:
        """Stop the workers for good (the agent ends): kept ones too."""
        super().shutdown(death_sig, timeout)
        if self.keeper is not None:
            self.keeper.discard()

    def _drain_for_join(self, grace_s: float) -> None:
        """Send the workers the join signal (``launch.env.JOIN_SIGNAL``) instead of
        SIGTERM, and wait up to ``grace_s`` for them to drain and exit; ``_shutdown``'s
        SIGTERM then finds nothing left (or stops what did not exit). A SIGTERM to this
        agent meanwhile (preemption) raises here as anywhere in the monitor loop, and the
        workers then get SIGTERM: a stop, saved to storage, if it comes before their drain
        step."""
        pcontext = self.pcontext
        if pcontext is None:
            return
        signal_workers(pcontext, JOIN_SIGNAL)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and not workers_exited(pcontext):
            if self._round_broken():  # a peer's group failed meanwhile: nothing left to drain for
                self._kill_workers()
                return
            time.sleep(self.monitor_interval)

    def _say_late_exits(self) -> None:
        """In place, a survivor's failed collective may be heard before this node's worker's
        exit is: the group then failed with no failure to say. The exits seen by the time the
        survivors parked are said now, as the group's account."""
        ranks = {w.local_rank: w.global_rank for w in self.worker_group.workers}
        failures = {ranks[lr]: f for lr, f in self.keeper.ended.items() if lr in ranks}
        if failures and not self._failure_said:
            self._failure_said = True
            self._on_failure({**exit_account(failures), "step": self._progress()})

    def _round_broken(self) -> bool:
        check = getattr(self.worker_group.spec.rdzv_handler, "round_broken", None)
        return bool(check is not None and check())

    def _kill_workers(self) -> None:
        """SIGKILL this node's workers: their group cannot finish (a peer's failed), and a
        worker blocked in a collective handles no other signal."""
        pcontext = self.pcontext
        for pid in (pcontext.pids().values() if pcontext is not None else ()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def monitor_workers(self, worker_group: Any) -> RunResult:
        self._wait_between_passes(worker_group)
        self._last_monitor = time.monotonic()
        self._tick()
        healthy = worker_group.state == WorkerState.HEALTHY
        heard = self.keeper is not None and self.keeper.hear(worker_group.spec.rdzv_handler, healthy)
        told = self.keeper is not None and self.keeper.verdict is not None  # the watchdog's verdict
        if healthy and not self._broken and (heard or told or self._round_broken()):
            self._stop_broken_group(worker_group)
        if worker_group.state == WorkerState.HEALTHY and not self.lost_lock:
            self._stop_if_lock_lost()
        before = self.remaining_restarts
        result = super().monitor_workers(worker_group)
        if self.keeper is not None and self._broken:  # in place: a group whose peer failed restarts, workers alive
            result = self.keeper.restarting(result, self.pcontext, self._restarts_after_failure(),
                                            self.stop_reason is not None)
        if result.state == WorkerState.SUCCEEDED:  # torch's exit barrier next: then the store's host may go
            getattr(worker_group.spec.rdzv_handler, "stop_changes", lambda: None)()
        self._account(worker_group, result, disabled_by_torch=before > 0 and self.remaining_restarts == 0)
        return result

    def _account(self, worker_group: Any, result: RunResult, *, disabled_by_torch: bool) -> None:
        """A failed group's account: its failure said, its peers told, the crash-loop judge
        asked, the restart budget settled, this node's strikes counted. ``disabled_by_torch``:
        torch's own "no more restarts" (a worker stuck in D-state): respected, never refilled."""
        failed = result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY)
        if failed and self._zygote is None:
            self._phase("stopped")  # torch's own process context stopped the rest already
        hung = self._stopped_workers() if failed else {}
        # In place, a peer's failure is said where it failed; a worker of this node found
        # stopped (it never parks: its peers' collectives timed out on it) is said here.
        self._failure_said = bool(failed and (result.failures or self.keeper is None or hung))
        if self._failure_said:
            self._on_failure({**exit_account(result.failures, hung), "step": self._progress()})
        handler = worker_group.spec.rdzv_handler  # ``rendezvous._Handler`` tells its peers
        if failed and crashed(result) and hasattr(handler, "group_failed"):
            handler.group_failed()
        if failed and lost_a_peer(result) and hasattr(handler, "peer_lost"):
            handler.peer_lost()
        if failed and self.stop_reason is None:
            reason = self._judge()
            if reason:
                self.stop_reason = reason
                self.remaining_restarts = 0
            elif not disabled_by_torch:
                self._settle_budget(result)
        if failed and self.strikes is not None and self.excluded is None:
            self.excluded = self.strikes.verdict(self._node_name)
            if self.excluded:  # kept out (``rendezvous.exclusion``): no restart, the rendezvous stays open
                self.remaining_restarts = 0
                self.on_excluded(self.excluded)
        if self.keeper is not None:
            self.keeper.restart_follows = failed and self.remaining_restarts > 0

    def _stop_if_lock_lost(self) -> None:
        """Another live job holds the run directory now (the lock's heartbeat found it): kill
        the workers (SIGKILL: no drain, no save: the directory is that job's) and start no
        more (``remaining_restarts``); the agent then ends with ``lost_lock``."""
        self.lost_lock = self.lock_lost(False)
        if self.lost_lock:
            self.stop_reason, self.remaining_restarts = self.lost_lock, 0
            self._kill_workers()

    def _wait_between_passes(self, worker_group: Any) -> None:
        """The monitor interval, less torch's tick, or until news (``await_news``); after a
        nudge, the rendezvous state is read again, so that ``_round_broken`` is current."""
        if self.await_news(self.monitor_interval - worker_group.spec.monitor_interval):
            refresh = getattr(worker_group.spec.rdzv_handler, "refresh", None)
            if refresh is not None:
                refresh()

    def _stop_broken_group(self, worker_group: Any) -> None:
        """A peer's group failed: ours cannot finish its step. Once per group. In place the
        workers leave their step and wait for their next place; else they are killed."""
        self._broken = True
        self._phase("broken")
        if getattr(worker_group.spec.rdzv_handler, "was_dropped", lambda: False)() and self.strikes:
            self.strikes.add("dropped from the rendezvous while its agent lived (its peers went on without it)")
        if self.keeper is not None and self.keeper.applies(self.pcontext, self._restarts_after_failure(),
                                                             self.stop_reason is not None):
            self.keeper.leave(self.pcontext)
            return
        self._kill_workers()

    def _restarts_after_failure(self) -> int:
        """The restarts torch's counter will hold once a failure seen now is settled
        (``_settle_budget``). A peer's failure heard before any exit of this node comes before
        that refill: torch's own counter may read 0 after a restart the window has since
        forgiven, and the group would be killed, not kept, for a failure that is restarted."""
        if self.excluded is not None or self.exhausted is not None:
            return 0
        return restarts_after_failure(self._failure_steps, self._progress(), self._budget, self._window)

    def _settle_budget(self, result: RunResult) -> None:
        """One failure seen: refill torch's counter for the restarts left, or empty it."""
        self._failure_steps.append(self._progress())
        left = restarts_left(self._failure_steps, self._budget, self._window)
        spec = self.worker_group.spec
        if left < 0:
            counted = self._budget - left
            self.exhausted = exhausted_message(counted, self._budget, self._window, first_failure(result))
            self.remaining_restarts = 0
            return
        spec.max_restarts, self.remaining_restarts = budget_refill(spec.max_restarts, self.remaining_restarts, left)


def workers_exited(pcontext: Any) -> bool:
    """Have all of the context's workers exited? Read without side effects: polling torch's
    way would take a drained worker's exit for a failure and stop the rest."""
    codes = getattr(pcontext, "_codes", None)  # ``WarmContext``: the zygote's reports
    if codes is not None:
        return len(codes()) >= pcontext.nprocs
    handlers = getattr(pcontext, "subprocess_handlers", None) or {}
    return all(h.proc.poll() is not None for h in handlers.values())


def bound_failure_close(pcontext: Any, grace_s: float) -> None:
    """Make ``pcontext.close()`` without a timeout (what torch's and ``WarmContext``'s
    ``_poll`` call when a worker failed, to stop the rest) wait ``grace_s``, not torch's fixed
    30 s (``policy.failed_stop_grace``). Calls with a timeout (the agent's ``_shutdown``:
    drains, stop requests) keep theirs."""
    close = pcontext.close

    def bounded(death_sig: Any = None, timeout: float | None = None) -> None:
        close(death_sig, grace_s if timeout is None else timeout)

    pcontext.close = bounded


DRAINED = 128 + int(signal.SIGTERM)  # a worker that drained and saved (``runtime.session.DRAIN_EXIT``)


def crashed(result: RunResult) -> bool:
    """Pure: did a worker of the failed group end other than by a drain? (Workers that all
    drained, for a join their peers asked for, left a consistent state: not a broken round.)"""
    return any(f.exitcode != DRAINED for f in result.failures.values())


def lost_a_peer(result: RunResult) -> bool:
    """Pure: did a worker of the failed group fail because a peer's connection closed or
    was reset (``liveness.peer_lost``, on the message torchelastic read from its error file)?"""
    return any(liveness.peer_lost(_message(f)) for f in result.failures.values())


def _message(failure: Any) -> str:
    message = failure.message
    return message.get("message", str(message)) if isinstance(message, dict) else str(message)


def exit_account(failures: dict[int, Any], stopped: dict[int, tuple[int, str]] | None = None) -> dict[str, Any]:
    """Pure: a failed group's ``failure`` event fields (``cause: exit``), the cause first.

    ``failures``: torchelastic's ``{global rank: ProcessFailure}``, in the order the exits
    were seen. A rank that only lost a peer (its error says the connection closed: a gloo
    "Connection closed by peer ... GLHF!") is a symptom, never the cause; the cause is the
    first other exit: a signal (``rank 1 (pid N) was killed by SIGKILL``), an exit without
    an error record, or an error the rank recorded. The survivors' symptom comes after.
    ``stopped``: ranks that had not exited but were found stopped (``{rank: (pid, /proc
    state)}``): a hung rank is the cause, before any exit (its peers timed out on it)."""
    if stopped:
        return _hung_account(failures, stopped)
    order = sorted(failures.items(), key=lambda kv: liveness.peer_lost(_message(kv[1])) and _recorded(kv[1]))
    if not order:
        return {"cause": "exit", "fatal": False, "message": "the worker group failed"}
    (rank, first), rest = order[0], order[1:]
    message = _exit_line(rank, first)
    if rest:
        message += "; then " + ", ".join(_exit_line(r, f, short=True) for r, f in rest)
    return {"cause": "exit", "fatal": False, "rank": rank, "worker_pid": first.pid,
            "exit_code": first.exitcode, "signal": _signal(first), "recorded": _recorded(first),
            "peer_lost": liveness.peer_lost(_message(first)) and _recorded(first), "message": message[:500]}


def _hung_account(failures: dict[int, Any], stopped: dict[int, tuple[int, str]]) -> dict[str, Any]:
    """Pure: ``exit_account`` of a group whose rank hung: that rank first, then each exit in
    short, without a survivor's gloo text ("rank 0 timed out waiting")."""
    from elastic_harness.rendezvous.exclusion import HANG_WORDS

    rank, (pid, state) = min(stopped.items())
    message = f"rank {rank} (pid {pid}) hung{HANG_WORDS.get(state, '')}: its peers waited on it"
    rest = [f"rank {r} timed out waiting" if "timed out" in _message(f).lower() else _exit_line(r, f, short=True)
            for r, f in failures.items() if r not in stopped]  # a hung rank the close killed: said
    if rest:
        message += "; then " + ", ".join(rest)
    return {"cause": "exit", "fatal": False, "rank": rank, "worker_pid": pid, "exit_code": None, "signal": None,
            "recorded": False, "peer_lost": False, "message": message[:500]}


def _recorded(failure: Any) -> bool:
    """Did the worker write its error (torchelastic's error file)?"""
    return str(getattr(failure, "error_file", "<N/A>")) not in ("<N/A>", "")


def _signal(failure: Any) -> str | None:
    import signal

    code = failure.exitcode
    if code is None or code >= 0:
        return None
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _exit_line(rank: int, failure: Any, short: bool = False) -> str:
    who = f"rank {rank}" if short else f"rank {rank} (pid {failure.pid})"
    sig = _signal(failure)
    if sig:
        return f"{who} was killed by {sig}" if not short else f"{who} stopped ({sig})"
    if not _recorded(failure):
        return f"{who} exited with code {failure.exitcode} without recording an error"
    text = " ".join(_message(failure).split())
    if liveness.peer_lost(text):  # after the cause, the symptom's text (gloo's "... GLHF!") adds nothing
        return f"{who} lost its peers" if short else f"{who} lost its peers ({text[:120]})"
    return f"{who} failed: {text[:300 if not short else 120]}"


def first_failure(result: RunResult) -> str:
    """'rank R exit C' of a failed group's first failure, for one-line messages."""
    if not result.failures:
        return "the worker group failed"
    rank, failure = min(result.failures.items(), key=lambda kv: kv[1].timestamp)
    return f"rank {rank} exit {failure.exitcode}"


@contextlib.contextmanager
def _processes_from(zygote: Zygote, phase: Callable[[str], None], keep: Keep | None = None) -> Iterator[None]:
    """torchelastic's ``start_processes``, answered by ``zygote`` while this block runs."""

    def warm_processes(name: str, entrypoint: Any, args: dict[int, tuple], envs: dict[int, dict[str, str]],
                       logs_specs: Any, log_line_prefixes: dict[int, str] | None = None, *,
                       cold: Callable[..., Any], **rest: Any) -> Any:
        if warm_invocation(entrypoint, [str(a) for a in args.get(0, ())]) is None:
            return cold(name=name, entrypoint=entrypoint, args=args, envs=envs, logs_specs=logs_specs,
                        log_line_prefixes=log_line_prefixes, **rest)
        if keep is not None:
            keep.hand_over(envs, zygote.exits)  # before torch's log files for the group: kept workers need none
        context = WarmContext(name, zygote, args, envs, logs_specs, log_line_prefixes, phase=phase, keep=keep)
        try:
            context.start()
        except BaseException:
            context.close()
            raise
        return context

    with processes_from(warm_processes):
        yield


class GroupLeft(RuntimeError):
    """The worker group ended in place (a peer's fault: every worker alive, parked) and no
    restart followed (this node kept out, or stopped): there is no worker failure to report,
    which torch's ``ChildFailedError`` requires."""


def closes_rendezvous(error: BaseException | None, *, excluded: bool) -> bool:
    """Pure: does this agent's end close the job's rendezvous, ending every node's part?
    Yes when the job is over for all: it finished (``error`` None), its workers failed past
    the restart budget, or this agent met an error of its own. No when the others can go on
    without this node: it was signalled (preempted), kept out (``rendezvous.exclusion``), or it
    lost its connection to the rendezvous store (the others may still reach the store, and
    a close would end them too; torch's agent closes it there)."""
    if error is None:
        return True
    if isinstance(error, (ChildFailedError, GroupLeft)):
        return not excluded
    return not isinstance(error, (SignalException, RendezvousConnectionError))


class Launch:
    """One node's agent for ``config``; ``run()`` once. ``agent.stop_reason`` says why it
    stopped restarting, when it did."""

    def __init__(self, config: Any, entrypoint: Callable | str, args: list[Any], settings: AgentSettings,
                 exit_barrier_s: float = 300.0, shutdown_grace: float = 30.0) -> None:
        params = RendezvousParameters(
            backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id,
            min_nodes=config.min_nodes, max_nodes=config.max_nodes, local_addr=config.local_addr,
            **config.rdzv_configs,
        )
        self.config = config
        self.spec = WorkerSpec(
            role=config.role, local_world_size=config.nproc_per_node, entrypoint=entrypoint,
            args=tuple(args), rdzv_handler=rendezvous.handler_for(params),
            max_restarts=config.max_restarts, monitor_interval=MONITOR_TICK_S,
            master_addr=None, master_port=None, local_addr=config.local_addr,
            event_log_handler=config.event_log_handler,
        )
        self.agent = HarnessAgent(spec=self.spec, logs_specs=config.logs_specs,
                                  start_method=config.start_method, shutdown_grace=shutdown_grace,
                                  exit_barrier_timeout=exit_barrier_s, settings=settings,
                                  monitor_interval=config.monitor_interval)
        on_change = getattr(self.spec.rdzv_handler, "on_change", None)
        if on_change is not None:  # a peer's write ends the agent's wait between monitor passes
            on_change(self.agent.nudge)

    def run(self) -> dict[int, Any]:
        """Run to the end; raises what ``launch_agent`` raises (``ChildFailedError``,
        ``SignalException``, rendezvous errors)."""
        config, agent, spec = self.config, self.agent, self.spec
        error: BaseException | None = None
        try:
            metrics.initialize_metrics(metrics.MetricsConfig(config.metrics_cfg))
            result = agent.run()
            events.record(agent.get_event_succeeded(), config.event_log_handler)
            if result.is_failed() and not result.failures:
                raise GroupLeft("the worker group left its step for a peer's fault, and no restart followed")
            if result.is_failed():
                raise ChildFailedError(name=spec.get_entrypoint_name(), failures=result.failures)
            return result.return_values
        except (ChildFailedError, GroupLeft) as e:
            error = e
            raise
        except BaseException as e:
            error = e
            events.record(agent.get_event_failed(), config.event_log_handler)
            raise
        finally:
            if closes_rendezvous(error, excluded=agent.excluded is not None):
                spec.rdzv_handler.shutdown()


def signal_workers(pcontext: Any, sig: signal.Signals) -> None:
    """Send ``sig`` to every worker of ``pcontext`` still running (None: none)."""
    for pid in (pcontext.pids().values() if pcontext is not None else ()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
