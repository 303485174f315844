"""Warm worker starts: the agent's side of the worker zygote (``runtime.zygote``).

``Zygote`` starts one zygote process per agent (early: its ``import torch`` overlaps the
first rendezvous) and asks it for workers; ``WarmContext`` is a torchelastic ``PContext``
whose processes are those forks, so torchelastic's agent monitors, stops and restarts them
as it does its own subprocesses (same environment, log files, error files, exit codes).

Why not torchelastic's own function entrypoints with the ``forkserver`` start method:
they pass return values through ``multiprocessing`` queues and events, whose named
semaphores live in ``/dev/shm`` and are removed only by Python's resource tracker, a
process in the agent's process group; killing that group (a node kill) leaves them behind.
Python's forkserver also binds a socket file in the temp dir. The zygote needs neither.

Call order (the agent's main thread): ``Zygote.start()`` once; ``WarmContext`` objects
created and closed by torchelastic through ``start_processes`` (see ``launch.elastic``);
``Zygote.stop()`` once at the end. If the zygote dies, the next worker start makes a new one.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from torch.distributed.elastic.multiprocessing.api import PContext, ProcessFailure, RunProcsResult

log = logging.getLogger(__name__)
ZYGOTE_MODULE = "elastic_harness.runtime.zygote"
MAX_MESSAGE = 1 << 20
_KILL_WAIT_S = 5.0  # after SIGKILL: a process in uninterruptible sleep may take a while


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


class ZygoteLost(RuntimeError):
    pass


class Zygote:
    """One agent's zygote process, and the exit codes of the workers it forked."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self.exits: dict[int, int] = {}  # pid -> exit code, as reported by the zygote
        self.threads: int | None = None  # threads the zygote ran after its imports

    def start(self) -> None:
        """Start the zygote (returns at once; it imports in the background)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", ZYGOTE_MODULE, str(theirs.fileno()), str(os.getpid())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self._sock = ours
        self.threads = None

    def spawn(self, module: str, argv: list[str], env: dict[str, str], *, stdout: str, stderr: str,
              unbuffered: bool) -> int:
        """Fork a worker running ``python -m module argv`` with exactly ``env``; its pid."""
        if self._proc is None or self._proc.poll() is not None:
            if self._proc is not None:
                log.warning("worker zygote exited (%s); starting a new one", self._proc.returncode)
                self.stop()
            self.start()
        self._send({"op": "spawn", "module": module, "argv": argv, "env": env, "cwd": os.getcwd(),
                    "stdout": stdout, "stderr": stderr, "unbuffered": unbuffered})
        while True:
            msg = self._recv(timeout=None)
            if msg["op"] == "spawned":
                return int(msg["pid"])
            if msg["op"] == "error":
                raise ZygoteLost(msg["message"])

    def signal(self, pid: int, sig: int) -> None:
        """Deliver ``sig`` to worker ``pid`` unless it already ended (no pid reuse races)."""
        if pid not in self.exits:
            self._send({"op": "signal", "pid": pid, "sig": int(sig)})

    def poll(self, timeout: float = 0.0) -> dict[int, int]:
        """Read what the zygote reported, waiting up to ``timeout`` s for a first message;
        the exit codes of every worker that ended so far (pid -> code)."""
        try:
            msg = self._recv(timeout)
            while msg is not None:
                msg = self._recv(0.0)
        except ZygoteLost:
            pass
        return self.exits

    def lost(self) -> bool:
        return self._sock is None or self._proc is None or self._proc.poll() is not None

    def stop(self) -> None:
        """Close the socket (the zygote exits) and reap it; safe to call twice."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=_KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def _send(self, msg: dict) -> None:
        if self._sock is None:
            raise ZygoteLost("the worker zygote is not running")
        try:
            self._sock.send(json.dumps(msg).encode())
        except OSError as e:
            raise ZygoteLost(f"the worker zygote is gone: {e!r}") from None

    def _recv(self, timeout: float | None) -> dict | None:
        """One message (``None`` if none came within ``timeout``); exit reports are kept."""
        if self._sock is None:
            raise ZygoteLost("the worker zygote is not running")
        ready, _, _ = select.select([self._sock], [], [], timeout)
        if not ready:
            return None
        data = self._sock.recv(MAX_MESSAGE)
        if not data:
            self._sock.close()
            self._sock = None
            raise ZygoteLost("the worker zygote exited")
        msg = json.loads(data)
        if msg["op"] == "exit":
            self.exits[int(msg["pid"])] = int(msg["code"])
        elif msg["op"] == "ready":
            # More than one: numpy's OpenBLAS pool (OMP_NUM_THREADS > 1), which shuts its
            # threads down around fork(); anything else would be worth a look.
            self.threads = int(msg["threads"])
            log.info("worker zygote ready: %d thread(s) after its imports", self.threads)
        return msg


class WarmContext(PContext):
    """torchelastic's view of one worker group forked by the zygote (see ``PContext``)."""

    def __init__(self, name: str, zygote: Zygote, args: dict[int, tuple], envs: dict[int, dict[str, str]],
                 logs_specs: Any, log_line_prefixes: dict[int, str] | None = None) -> None:
        super().__init__(name, sys.executable, args, envs, logs_specs, log_line_prefixes)
        self.zygote = zygote
        self._pids: dict[int, int] = {}
        self._failures: dict[int, ProcessFailure] = {}

    def _start(self) -> None:
        for local_rank in range(self.nprocs):
            invocation = warm_invocation(self.entrypoint, [str(a) for a in self.args[local_rank]])
            if invocation is None:
                raise AssertionError("callers check warm_invocation before choosing a WarmContext")
            module, argv, unbuffered = invocation
            env = {**os.environ, **self.envs[local_rank]}  # what torchelastic's Popen passes
            self._pids[local_rank] = self.zygote.spawn(
                module, argv, env, stdout=self.stdouts[local_rank], stderr=self.stderrs[local_rank],
                unbuffered=unbuffered)

    def _codes(self) -> dict[int, int]:
        """Exit codes of the local ranks that ended (a lost zygote took its workers along)."""
        exits = self.zygote.poll()
        codes = {lr: exits[pid] for lr, pid in self._pids.items() if pid in exits}
        if self.zygote.lost():
            codes.update({lr: -signal.SIGKILL for lr in self._pids if lr not in codes})
        return codes

    def _poll(self) -> RunProcsResult | None:
        codes = self._codes()
        self._note_failures(codes)
        if len(codes) < self.nprocs and not self._failures:
            return None
        self.close()  # a failure ends the group: stop the rest
        self._note_failures(self._codes())
        result = RunProcsResult(failures=self._failures, stdouts=self.stdouts, stderrs=self.stderrs)
        if not result.is_failed():
            result.return_values = dict.fromkeys(range(self.nprocs))
        return result

    def _note_failures(self, codes: dict[int, int]) -> None:
        for lr, code in codes.items():
            if code != 0 and lr not in self._failures:
                self._failures[lr] = ProcessFailure(local_rank=lr, pid=self._pids[lr], exitcode=code,
                                                    error_file=self.error_files[lr])

    def pids(self) -> dict[int, int]:
        return dict(self._pids)

    def _close(self, death_sig: signal.Signals, timeout: int = 30) -> None:
        """``death_sig`` to the workers still running, SIGKILL after ``timeout`` s."""
        if not self._wait_for_all(death_sig, timeout):
            log.warning("workers did not stop within %s s of %s; killing them", timeout, death_sig.name)
            if not self._wait_for_all(signal.SIGKILL, _KILL_WAIT_S):
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
