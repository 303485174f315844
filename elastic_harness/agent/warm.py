"""Warm worker starts: torchelastic's worker group as forks of the agent's zygote.

``WarmContext`` is a torchelastic ``PContext`` whose processes the zygote (``agent.zygote``,
``runtime.zygote``) forks, so torchelastic's agent monitors, stops and restarts them as it
does its own subprocesses: the same environment, log files, error files and exit codes. The
agent subclass (``agent.elastic``) uses it for worker commands ``warm_invocation`` accepts.

Why not torchelastic's own function entrypoints with the ``forkserver`` start method:
they pass return values through ``multiprocessing`` queues and events, whose named
semaphores live in ``/dev/shm`` and are removed only by Python's resource tracker, a
process in the agent's process group; killing that group (a node kill) leaves them behind.
Python's forkserver also binds a socket file in the temp dir. The zygote needs neither.

In place (``Keep``: the job's ``recovery: in_place``), each worker also gets a control line
(``agent.control``). A failed worker then no longer stops its siblings: they are told to
``leave`` the step (their collectives return), the failure is reported to torchelastic,
which restarts the group; the agent ``release``s the survivors from this context before it
stops it (``agent.elastic``); torchelastic's variables for their place in the new generation
go to them as a ``reform`` order as soon as torch has made them (``Keep.hand_over``, before
the next context sets up its log files), the next context ``adopt``s them, and only the local
ranks without a live worker are forked.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from torch.distributed.elastic.multiprocessing.api import ProcessFailure, RunProcsResult

from elastic_harness.agent.control import Lines
from elastic_harness.agent.zygote import STOP_WAIT_S, Zygote, ZygoteLost
from elastic_harness.torchcompat.agent import ContextBase

log = logging.getLogger(__name__)

# What torchelastic records as the error file of a worker that wrote none (its ``<N/A>``).
NO_ERROR_FILE = "<N/A>"

# Seconds the rest of a failed group get to end on their own before they are stopped: a rank
# whose peer died fails in its next collective and, on its way down, keeps the step it
# completed in memory (``checkpoint.memory_on_failure``); a SIGTERM sent the moment the first
# exit is reported (the agent waits for reports, not a fixed interval) can come before that.
# The wait ends as soon as every worker has exited.
SURVIVOR_GRACE_S = 0.05


def process_failure(local_rank: int, pid: int, exitcode: int, error_file: str) -> ProcessFailure:
    """torchelastic's ``ProcessFailure`` for a worker that ended, read from its error file when
    that file is whole.

    A worker stopped while it writes its error file (the group is being stopped because a
    peer died, and this rank is recording the error the peer's death caused) leaves it empty
    or cut short. torch's ``ProcessFailure`` raises on such a file, which would end the agent
    (and the job) with restarts left; it is read here as no error file at all, as for a
    worker killed by a signal.
    """
    if os.path.isfile(error_file):
        try:
            with open(error_file) as fp:
                json.load(fp)
        except (OSError, ValueError):
            log.warning("local rank %s (pid %s) left an unreadable error file %s; it is ignored",
                        local_rank, pid, error_file)
            error_file = NO_ERROR_FILE
    return ProcessFailure(local_rank=local_rank, pid=pid, exitcode=exitcode, error_file=error_file)


def warm_invocation(entrypoint: Any, args: Sequence[str]) -> tuple[str, list[str], bool] | None:
    """Pure: ``(module, argv, unbuffered)`` when the worker command is this interpreter running
    ``[-u] -m MODULE ARGV``, which a zygote can run warm; None for anything else."""
    if entrypoint != sys.executable:
        return None
    args = list(args)
    unbuffered = bool(args) and args[0] == "-u"
    rest = args[1:] if unbuffered else args
    if len(rest) < 2 or rest[0] != "-m":
        return None
    return rest[1], rest[2:], unbuffered


class WarmContext(ContextBase):
    """torchelastic's view of one worker group forked by the zygote (see ``PContext``,
    whose hooks ``torchcompat.agent.ContextBase`` names)."""

    def __init__(self, name: str, zygote: Zygote, args: dict[int, tuple], envs: dict[int, dict[str, str]],
                 logs_specs: Any, log_line_prefixes: dict[int, str] | None = None,
                 phase: Callable[[str], None] = lambda state: None, keep: Keep | None = None) -> None:
        super().__init__(name, sys.executable, args, envs, logs_specs, log_line_prefixes)
        self.zygote = zygote
        self._phase = phase  # hears "failed" and "stopped" (agent.elastic's report)
        self._pids: dict[int, int] = {}
        self._failures: dict[int, ProcessFailure] = {}
        self.keep = keep  # in place: the control lines and the workers kept from the last group
        self.adopted: dict[int, int] = {}  # local rank -> pid of a worker re-formed, not forked
        # local rank -> (pid, /proc state) of workers found stopped when their group failed
        self.stopped: dict[int, tuple[int, str]] = {}

    def start_processes(self) -> None:
        for local_rank in range(self.nprocs):
            if self._adopt(local_rank):
                continue
            invocation = warm_invocation(self.entrypoint, [str(a) for a in self.args[local_rank]])
            if invocation is None:
                raise AssertionError("callers check warm_invocation before choosing a WarmContext")
            module, argv, unbuffered = invocation
            env = {**os.environ, **self.envs[local_rank]}  # what torchelastic's Popen passes
            line = None
            if self.keep is not None:
                ours, line = Lines.open_line()
            try:
                pid = self.zygote.spawn(module, argv, env, stdout=self.stdouts[local_rank],
                                        stderr=self.stderrs[local_rank], unbuffered=unbuffered, line=line)
            finally:
                if line is not None:
                    line.close()
            self._pids[local_rank] = pid
            if self.keep is not None:
                self.keep.lines.adopt(pid, ours)

    def _adopt(self, local_rank: int) -> bool:
        """In place: the kept worker of ``local_rank`` takes its new place (a ``reform``
        order with torchelastic's variables for it); False when there is none to take it."""
        if self.keep is None:
            return False
        pid = self.keep.kept.pop(local_rank, None)
        if pid is None or pid in self.zygote.exits:
            return False
        if not self.keep.ordered.pop(pid, False) and not self.keep.order(pid, self.envs[local_rank]):
            self.zygote.signal(pid, signal.SIGKILL)  # its line is gone: it cannot be re-formed
            return False
        self._pids[local_rank] = self.adopted[local_rank] = pid
        return True

    def _codes(self) -> dict[int, int]:
        """Exit codes of the local ranks that ended (a lost zygote took its workers along)."""
        exits = self.zygote.poll()
        codes = {lr: exits[pid] for lr, pid in self._pids.items() if pid in exits}
        if self.zygote.lost():
            codes.update({lr: -signal.SIGKILL for lr in self._pids if lr not in codes})
        return codes

    def poll_processes(self) -> RunProcsResult | None:
        codes = self._codes()
        self._note_failures(codes)
        if len(codes) < self.nprocs and not self._failures:
            return None
        if self._failures and self.keep is not None and len(codes) < self.nprocs:
            # In place: the survivors leave the step and wait for their next place; the
            # agent releases them from this context before stopping it (``release``).
            self._phase("failed")
            self.stopped = self.hung()  # a frozen rank among them is the cause (it never parks)
            self.leave(f"local rank(s) {sorted(self._failures)} of this node ended")
            return RunProcsResult(failures=dict(self._failures), stdouts=self.stdouts, stderrs=self.stderrs)
        if self._failures:
            self._phase("failed")
            self._await_exits(SURVIVOR_GRACE_S)
            self.stopped = self.hung()  # before the close kills them: a hung rank is the cause
        self.close()  # a failure ends the group: stop the rest
        if self._failures:
            self._phase("stopped")
        self._note_failures(self._codes())
        result = RunProcsResult(failures=self._failures, stdouts=self.stdouts, stderrs=self.stderrs)
        if not result.is_failed():
            result.return_values = dict.fromkeys(range(self.nprocs))
        return result

    def hung(self) -> dict[int, tuple[int, str]]:
        """The workers still running that are stopped (a signal, a tracer, uninterruptible
        sleep: ``rendezvous.exclusion.OWN_HANG_STATES``): {local rank: (pid, state)}."""
        from elastic_harness.agent.watchdog import process_state
        from elastic_harness.rendezvous.exclusion import OWN_HANG_STATES

        running = set(self._running())
        found = {lr: (pid, process_state(pid)) for lr, pid in self._pids.items() if pid in running}
        return {lr: (pid, state) for lr, (pid, state) in found.items() if state in OWN_HANG_STATES}

    def _await_exits(self, grace_s: float) -> None:
        """Until every worker has exited (the zygote's reports) or ``grace_s`` passed."""
        deadline = time.monotonic() + grace_s
        while len(self._codes()) < self.nprocs and not self.zygote.lost():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self.zygote.poll(timeout=left)

    def _note_failures(self, codes: dict[int, int]) -> None:
        for lr, code in codes.items():
            if code != 0 and lr not in self._failures:
                self._failures[lr] = process_failure(lr, self._pids[lr], code, self.error_files[lr])

    def pids(self) -> dict[int, int]:
        return dict(self._pids)

    def ended(self) -> dict[int, Any]:
        """The workers that ended with an error so far (local rank -> ProcessFailure)."""
        self._note_failures(self._codes())
        return dict(self._failures)

    def live(self) -> dict[int, int]:
        """local rank -> pid of the workers that have not ended."""
        exits = self.zygote.exits
        return {lr: pid for lr, pid in self._pids.items() if pid not in exits}

    def leave(self, reason: str, remote: bool = False) -> None:
        """Tell every live worker to leave its step (in place); ``remote``: for another node's
        failure (``runtime.control``)."""
        if self.keep is None:
            return
        for pid in self.live().values():
            self.keep.lines.say(pid, "leave", reason=reason, remote=remote)

    def release(self, local_ranks: dict[int, int]) -> None:
        """Forget these live workers (local rank -> pid): this context no longer stops them;
        the next one adopts them (``Keep``)."""
        for lr in local_ranks:
            self._pids.pop(lr, None)
        self.nprocs = len(self._pids)

    def close_processes(self, death_sig: signal.Signals, timeout: int = 30) -> None:
        """``death_sig`` to the workers still running, SIGKILL after ``timeout`` s."""
        if not self._wait_for_all(death_sig, timeout):
            log.warning("workers did not stop within %s s of %s; killing them", timeout, death_sig.name)
            if not self._wait_for_all(signal.SIGKILL, STOP_WAIT_S):
                log.error("workers %s did not exit after SIGKILL", self._running())

    def _running(self) -> list[int]:
        exits = self.zygote.exits
        return [pid for pid in self._pids.values() if pid not in exits]

    def _wait_for_all(self, sig: signal.Signals, timeout: float) -> bool:
        try:
            for pid in self._running():
                self.zygote.signal(pid, sig)
        except ZygoteLost:
            return True  # the workers died with it (parent-death signal)
        deadline = time.monotonic() + timeout
        while self._running() and not self.zygote.lost():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.zygote.poll(timeout=min(left, 0.5))
        return True


class Keep:
    """What in-place recovery carries from one worker group to the next on this node: the
    control lines (``agent.control``) and the workers kept alive (local rank -> pid)."""

    def __init__(self) -> None:
        self.lines = Lines()
        self.kept: dict[int, int] = {}
        self.ordered: dict[int, bool] = {}  # kept pids told their next place (``hand_over``), not adopted yet

    def order(self, pid: int, env: dict[str, str]) -> bool:
        """Tell kept worker ``pid`` its place in the next group (a ``reform`` order with
        torchelastic's variables for it); False if its line is gone."""
        self.lines.take(pid)  # what it said in the last generation (its ``parked``) is done
        return self.lines.say(pid, "reform", env=env)

    def hand_over(self, envs: dict[int, dict[str, str]], exits: Any) -> None:
        """Each kept worker's place, as soon as torch has made the next group's variables
        (``envs``, by local rank): before torch sets up that group's log files, which a kept
        worker does not write to (its log goes on in the file of the attempt it started in),
        so its re-formation overlaps the rest of the agent's start. The group's context adopts
        it (``WarmContext._adopt``); one whose line is gone is told again there, and replaced."""
        for local_rank, pid in self.kept.items():
            if local_rank in envs and pid not in exits and self.order(pid, envs[local_rank]):
                self.ordered[pid] = True

    def discard(self, zygote: Zygote) -> None:
        """Kept workers no group adopted (the agent stops): SIGKILL them."""
        for pid in self.kept.values():
            with contextlib.suppress(ZygoteLost):
                zygote.signal(pid, signal.SIGKILL)
            self.lines.drop(pid)
        self.kept.clear()
        self.ordered.clear()
