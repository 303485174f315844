"""Ask a peer's host whether its agent's process is still there.

Each agent keeps a ``Beacon``: a listening socket on its node's address, and a thread that
answers every connection with one byte and closes it. The address is written next to the
agent's keep-alives (``liveness.identity``), so every peer knows where to ask. ``probe``
tells three answers apart, each from the peer's own kernel or process:

- ``GONE``: the connection was refused. The host is up (its kernel answered) but nothing
  listens there any more: the agent's process is gone (a process that dies has its sockets
  closed by the kernel, which then refuses connections, as it resets the ones that were
  open). This is the certainty that a pid gives on a shared host, for another host;
- ``ALIVE``: the byte came back: the agent's process runs and answers;
- ``SILENT``: neither within the timeout: the host is down or cut off, or the agent is
  frozen (a stopped process's kernel still accepts the connection, but nobody answers) or
  just slow. Says nothing for certain: ``rendezvous.verdict`` weighs it with other evidence.

Nothing is read from the connection and nothing but one constant byte is written: the
beacon needs no authentication. It listens on the node's own address (the job's network),
never on every interface.

Call order: ``Beacon(host).start()`` once per agent, ``address`` into the identity,
``close()`` at the end (or the process's exit; ``close`` ends the thread too); ``probe(...)``
from any thread.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable

from elastic_harness.listen import listener

GONE, ALIVE, SILENT = "gone", "alive", "silent"
ANSWER = b"\x01"
CLOSE_WAIT_S = 5.0  # ``Beacon.close`` waits this long at most for its thread to end


class Beacon:
    """Answers every connection on ``host`` (an address of this node) with ``ANSWER``."""

    def __init__(self, host: str) -> None:
        self._sock = listener(host, 0, backlog=128)
        name = self._sock.getsockname()
        self.address = f"{host}:{name[1]}"
        self._thread = threading.Thread(target=self._serve, name="liveness-beacon", daemon=True)

    def start(self) -> Beacon:
        self._thread.start()
        return self

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with contextlib.suppress(OSError), conn:
                conn.sendall(ANSWER)

    def close(self) -> None:
        """Stop listening (the kernel refuses connections from now on) and end the thread:
        the shutdown wakes its ``accept``."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(CLOSE_WAIT_S)


def probe(address: str, timeout_s: float) -> str:
    """``GONE``, ``ALIVE`` or ``SILENT`` for the beacon at ``address`` (``HOST:PORT``)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return SILENT
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as conn:
            conn.settimeout(timeout_s)
            return ALIVE if conn.recv(1) == ANSWER else SILENT
    except ConnectionRefusedError:
        return GONE
    except OSError:  # timed out, unreachable, reset
        return SILENT


class Asker:
    """``probe`` with its answers kept ``keep_s`` seconds per address: the rendezvous state is
    judged at every sync (several a second while an agent waits), a beacon asked at most once
    a ``keep_s``. A ``GONE`` is kept for good (a process does not come back)."""

    def __init__(self, timeout_s: float = 0.5, keep_s: float = 1.0,
                 ask: Callable[[str, float], str] = probe, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s, self.keep_s, self._ask, self._clock = timeout_s, keep_s, ask, clock
        self._answers: dict[str, tuple[float, str]] = {}

    def __call__(self, address: str) -> str:
        now = self._clock()
        known = self._answers.get(address)
        if known is not None and (known[1] == GONE or now - known[0] < self.keep_s):
            return known[1]
        answer = self._ask(address, self.timeout_s)
        self._answers[address] = (self._clock(), answer)
        return answer
