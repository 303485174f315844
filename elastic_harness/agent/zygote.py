"""The agent's handle on its worker zygote (``runtime.zygote``): start it, ask it for
workers, signal them, learn their exit codes. No torch import here: the zygote imports it.

Call order (the agent's main thread): ``start()`` once, early (the zygote's imports then
overlap the agent's own); ``wait_ready`` before the first rendezvous; ``spawn``/``signal``/``poll`` as torchelastic starts, watches
and stops worker groups (``agent.warm.WarmContext``); ``stop()`` once at the end. If the
zygote died, the next ``spawn`` starts a new one (and waits for its imports).

``preload`` names the modules the zygote imports (None: its default list, torch and the
harness's worker side); tests pass an empty tuple to get a zygote that starts at once;
``also``: more on top (the host's zygote of a local run, which forks agents).

An agent that its host's zygote forked (``run`` on one machine) finds a worker zygote forked
with it, with nothing left to import (``launch.env.ZYGOTE_VAR``): ``start`` adopts that one
instead of starting a process, and ``release_inherited`` ends it where no zygote is used.
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
from collections.abc import Mapping, Sequence

from elastic_harness.launch.env import ZYGOTE_VAR

log = logging.getLogger(__name__)
ZYGOTE_MODULE = "elastic_harness.runtime.zygote"
MAX_MESSAGE = 1 << 20
STOP_WAIT_S = 5.0


class ZygoteLost(RuntimeError):
    """The zygote is gone (its workers died with it) or refused a request."""


class Zygote:
    """One agent's zygote process, and the exit codes of the workers it forked."""

    def __init__(self, preload: Sequence[str] | None = None, also: Sequence[str] = (),
                 env: Mapping[str, str] | None = None) -> None:
        self.preload, self.also, self.env = preload, tuple(also), env
        self._proc: subprocess.Popen | Forked | None = None
        self._sock: socket.socket | None = None
        self.exits: dict[int, int] = {}  # pid -> exit code, as reported by the zygote
        self.threads: int | None = None  # threads the zygote ran after its imports

    def start(self) -> None:
        """Start the zygote (returns at once; it imports in the background), or adopt the
        one forked with this process (module doc)."""
        self.threads = None
        inherited = take_inherited()
        if inherited is not None:
            self._sock, self._proc = inherited
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            # Its own session, like torchelastic's workers: signals for the agent's process
            # group (a SIGTERM to drain) must reach the workers through the agent, not kill
            # the zygote, whose death takes its workers along (parent-death signal).
            cmd = [sys.executable, "-m", ZYGOTE_MODULE, str(theirs.fileno()), str(os.getpid())]
            if self.preload is not None:
                cmd += ["--preload", ",".join(self.preload)]
            if self.also:
                cmd += ["--also", ",".join(self.also)]
            self._proc = subprocess.Popen(cmd, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                          start_new_session=True, env=self.env)
        finally:
            theirs.close()
        self._sock = ours

    def spawn(self, module: str, argv: list[str], env: dict[str, str], *, stdout: str, stderr: str,
              unbuffered: bool, line: socket.socket | None = None) -> int:
        """Fork a worker running ``python -m module argv`` with exactly ``env``; its pid.
        ``line``: the worker's end of its control channel (``agent.control``), handed over
        with the request; the worker finds it named by ``runtime.control.CONTROL_FD_VAR``."""
        if self._proc is None or self._proc.poll() is not None:
            if self._proc is not None:
                log.warning("worker zygote exited (%s); starting a new one", self._proc.returncode)
                self.stop()
            self.start()
        return self._spawned({"op": "spawn", "module": module, "argv": argv, "env": env, "cwd": os.getcwd(),
                              "stdout": stdout, "stderr": stderr, "unbuffered": unbuffered},
                             fds=[line.fileno()] if line is not None else [])

    def spawn_agent(self, module: str, argv: list[str], env: dict[str, str], log_path: str) -> int:
        """Fork a node's agent (the host zygote, module doc): ``python -m module argv`` with
        ``env``, both streams appended to ``log_path``, and a worker zygote of its own forked
        with it; its pid. Raises ``ZygoteLost`` if the zygote is gone (no restart here)."""
        return self._spawned({"op": "spawn", "module": module, "argv": argv, "env": env, "cwd": os.getcwd(),
                              "stdout": log_path, "stderr": log_path, "unbuffered": True, "append": True,
                              "zygote": True})

    def _spawned(self, request: dict, fds: Sequence[int] = ()) -> int:
        self._send(request, fds=fds)
        while True:
            msg = self._recv(timeout=None)
            if msg["op"] == "spawned":
                return int(msg["pid"])
            if msg["op"] == "error":
                raise ZygoteLost(msg["message"])

    def import_more(self, modules: Sequence[str], env: Mapping[str, str]) -> None:
        """Have the zygote import ``modules`` now (after anything asked before), with
        ``env`` added to its environment first; forks made later inherit them."""
        self._send({"op": "preload", "modules": list(modules), "env": dict(env)})

    def wait_ready(self, timeout: float) -> bool:
        """Block until the zygote finished its imports (its ``ready`` message), it died, or
        ``timeout`` s passed; whether it is ready. Called before the agent first joins the
        rendezvous (``agent.node``)."""
        deadline = time.monotonic() + timeout
        while self.threads is None and not self.lost():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.poll(left)
        return self.threads is not None

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

    @property
    def pid(self) -> int | None:
        """The zygote's pid while it runs (started or adopted), else None."""
        return None if self._proc is None else self._proc.pid

    def fileno(self) -> int | None:
        """The socket the zygote reports on (readable when a report waits), None when gone."""
        return None if self._sock is None else self._sock.fileno()

    def lost(self) -> bool:
        return self._sock is None or self._proc is None or self._proc.poll() is not None

    def stop(self, grace_s: float = STOP_WAIT_S) -> None:
        """Close the socket (the zygote exits) and reap it, killed after ``grace_s`` (0: a
        zygote nothing was asked of, which would only finish its imports first); safe to
        call twice."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def _send(self, msg: dict, fds: Sequence[int] = ()) -> None:
        if self._sock is None:
            raise ZygoteLost("the worker zygote is not running")
        try:
            if fds:
                socket.send_fds(self._sock, [json.dumps(msg).encode()], list(fds))
            else:
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
        try:
            data = self._sock.recv(MAX_MESSAGE)
        except OSError:  # ECONNRESET: the zygote died with messages unread
            data = b""
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


class Forked:
    """A child this process forked itself (the worker zygote forked with an agent), with
    the part of ``Popen``'s interface the handle uses: ``pid``, ``poll``, ``wait``, ``kill``."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its code is lost
                self.returncode = -signal.SIGKILL
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is None:
            try:
                fd = os.pidfd_open(self.pid)
            except ProcessLookupError:  # gone already: ``poll`` says so
                return self.poll()
            try:
                ready, _, _ = select.select([fd], [], [], timeout)
            finally:
                os.close(fd)
            if not ready:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
        return self.poll()

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


def take_inherited() -> tuple[socket.socket, Forked] | None:
    """The worker zygote forked with this process (``ZYGOTE_VAR``), taken out of the
    environment (workers must not inherit the name), or None."""
    value = os.environ.pop(ZYGOTE_VAR, None)
    if not value:
        return None
    fd, pid = (int(v) for v in value.split(","))
    return socket.socket(fileno=fd), Forked(pid)


def release_inherited() -> None:
    """End the worker zygote forked with this process, if any (an agent without warm
    starts): adopted, then stopped as any zygote is."""
    if os.environ.get(ZYGOTE_VAR):
        zygote = Zygote()
        zygote.start()  # adopts it: nothing is started
        zygote.stop()
