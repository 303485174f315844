"""The agent's ends of its workers' control channels (``runtime.control`` is the worker's).

``Lines`` holds one ``SOCK_SEQPACKET`` socket pair per worker process: ``open_line`` makes
a pair before the zygote forks the worker, the worker's end travels with the spawn request
(``SCM_RIGHTS``) and the agent keeps its own, keyed by the worker's pid once known. The
agent ``say``s ``leave`` / ``reform`` / ``exit`` to a worker and ``hear``s what its workers
told it since (``broken``, ``parked``, ``reformed``, ``rerun``). JSON only, both ways.
"""

from __future__ import annotations

import contextlib
import json
import socket
from typing import Any

MAX_MESSAGE = 1 << 20


class Lines:
    def __init__(self) -> None:
        self._by_pid: dict[int, socket.socket] = {}
        self.heard: dict[int, list[dict[str, Any]]] = {}  # by pid, in order, until ``take``n
        self.live: set[int] = set()  # workers that said ``live``: they keep their process through a fault

    @staticmethod
    def open_line() -> tuple[socket.socket, socket.socket]:
        """(the agent's end, the worker's end). The caller passes the worker's end to the
        zygote and closes its own copy of it once the worker was spawned."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        return ours, theirs

    def adopt(self, pid: int, sock: socket.socket) -> None:
        self._by_pid[pid] = sock

    def pids(self) -> list[int]:
        return list(self._by_pid)

    def fileno_map(self) -> dict[int, int]:
        """socket descriptor -> worker pid (for the agent's wait for news)."""
        return {s.fileno(): pid for pid, s in self._by_pid.items()}

    def say(self, pid: int, op: str, **fields: Any) -> bool:
        """One message to worker ``pid``; False if it has no line or the line is gone."""
        sock = self._by_pid.get(pid)
        if sock is None:
            return False
        try:
            sock.send(json.dumps({"op": op, **fields}).encode())
            return True
        except OSError:
            self.drop(pid)
            return False

    def hear(self) -> list[tuple[int, dict[str, Any]]]:
        """Every message waiting on any line, in order per worker; a closed line is dropped."""
        got: list[tuple[int, dict[str, Any]]] = []
        for pid, sock in list(self._by_pid.items()):
            while True:
                try:
                    data = sock.recv(MAX_MESSAGE)
                except BlockingIOError:
                    break
                except OSError:
                    data = b""
                if not data:
                    self.drop(pid)
                    break
                with contextlib.suppress(ValueError):
                    msg = json.loads(data)
                    if isinstance(msg, dict):
                        got.append((pid, msg))
                        self.heard.setdefault(pid, []).append(msg)
                        if msg.get("op") == "live":
                            self.live.add(pid)
        return got

    def take(self, pid: int) -> list[dict[str, Any]]:
        return self.heard.pop(pid, [])

    def drop(self, pid: int) -> None:
        self.live.discard(pid)
        self.heard.pop(pid, None)
        sock = self._by_pid.pop(pid, None)
        if sock is not None:
            sock.close()

    def close(self) -> None:
        for pid in list(self._by_pid):
            self.drop(pid)
