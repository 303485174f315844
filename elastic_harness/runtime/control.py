"""The worker's end of its agent's control channel (``agent.control`` is the agent's).

A socket pair the agent makes for each worker it starts (the zygote hands this end over at
the fork; ``CONTROL_FD_VAR`` names it). One JSON object per ``SOCK_SEQPACKET`` message:
nothing read here is unpickled, and only this worker's agent holds the other end.

From the agent:
  ``{"op": "leave", "reason", "remote"}``  a peer failed: end the current generation now
                                 (``on_leave``, on the reader thread: a collective blocked on
                                 the lost peer returns, the training thread reaches a park
                                 point); ``remote``: the failure is another node's (no rank of
                                 this node is known failed or stalled);
  ``{"op": "reform", "env"}``    this worker's place in the next generation (the variables
                                 torchelastic would start a worker with);
  ``{"op": "exit"}``             no next generation for this process: exit (the agent
                                 falls back to a restart).
To the agent (``tell``): ``broken`` (a collective failed: a peer is lost), ``parked`` (the
step this rank rolls back to), ``reformed`` (the phases), ``rerun`` (the training function
starts again in this process).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from elastic_harness.runtime.zygote import CONTROL_FD_VAR  # the zygote names it; torch-free

MAX_MESSAGE = 1 << 20


class Control:
    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._send_lock = threading.Lock()
        self._orders: queue.SimpleQueue = queue.SimpleQueue()  # reform / exit / closed
        self._reader: threading.Thread | None = None
        self.on_leave: Callable[[str, bool], None] = lambda reason, remote: None
        self.left: str | None = None  # the reason of the last ``leave`` not yet answered by a reform

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Control | None:
        """The channel our agent handed this worker, or None (plain torchrun, python, or an
        agent that runs every fault as a restart)."""
        value = environ.get(CONTROL_FD_VAR, "")
        if not value.isdigit():
            return None
        try:
            sock = socket.socket(fileno=int(value))
        except OSError:
            return None
        if sock.type != socket.SOCK_SEQPACKET:
            sock.detach()
            return None
        return cls(sock)

    def start(self) -> Control:
        if self._reader is None:
            self._reader = threading.Thread(target=self._read, daemon=True, name="harness-control")
            self._reader.start()
        return self

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                self._orders.put({"op": "closed"})
                return
            try:
                msg = json.loads(data)
            except ValueError:
                continue  # only our agent holds the other end: a torn message is dropped
            if not isinstance(msg, dict):
                continue
            if msg.get("op") == "leave":
                self.left = str(msg.get("reason", "a peer failed"))
                self.on_leave(self.left, msg.get("remote") is True)
            elif msg.get("op") in ("reform", "exit"):
                self._orders.put(msg)

    def tell(self, op: str, **fields: Any) -> None:
        """One message to the agent (any thread); a closed channel is not an error here:
        the next ``await_order`` says so."""
        data = json.dumps({"op": op, "pid": os.getpid(), **fields}).encode()
        with self._send_lock, contextlib.suppress(OSError):
            self._sock.send(data)

    def await_order(self, timeout_s: float) -> dict:
        """The agent's next ``reform`` or ``exit``; ``{"op": "timeout"}`` or
        ``{"op": "closed"}`` when none comes."""
        deadline = time.monotonic() + timeout_s
        try:
            order = self._orders.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return {"op": "timeout"}
        if order.get("op") == "reform":
            self.left = None
        return order

    def pending_order(self) -> bool:
        return not self._orders.empty()
