"""Agent-side isolation watchdog: an agent cut off from the rendezvous takes itself down.

A partitioned agent was seen blocked for over 13 minutes in ``recvfrom`` on its store
socket, ignoring SIGTERM. This thread probes the rendezvous endpoint (a TCP connect, which
works for the c10d store and for etcd alike) every ``interval`` seconds; after
``limit`` seconds without one success it records an ``isolated`` event and ends the agent
process with ``os._exit`` (which no blocked call can stop). The workers die with it
(``PR_SET_PDEATHSIG``), so a node that comes back after a partition writes nothing more
into the job's checkpoints; a fresh agent can rejoin through the rendezvous.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable

EXIT_ISOLATED = 1


def reachable(host: str, port: int, timeout: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def isolated_for(last_ok: float, now: float, limit: float) -> bool:
    """Pure: has the endpoint been unreachable for longer than ``limit``?"""
    return now - last_ok > limit


class IsolationWatchdog:
    def __init__(self, endpoint: str, limit: float, on_isolated: Callable[[float], None],
                 interval: float = 1.0, probe: Callable[[str, int, float], bool] = reachable) -> None:
        host, _, port = endpoint.rpartition(":")
        self.host, self.port = host, int(port)
        self.limit, self.interval = limit, interval
        self.on_isolated, self.probe = on_isolated, probe
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="isolation-watchdog", daemon=True)

    def start(self) -> IsolationWatchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        last_ok = time.monotonic()
        while not self._stop.wait(self.interval):
            if self.probe(self.host, self.port, min(2.0, self.limit / 2)):
                last_ok = time.monotonic()
            elif isolated_for(last_ok, time.monotonic(), self.limit):
                self.on_isolated(time.monotonic() - last_ok)
                return


def exit_isolated(events, node: str, endpoint: str) -> Callable[[float], None]:
    def act(seconds: float) -> None:
        events.emit("isolated", node=node, endpoint=endpoint, seconds=round(seconds, 2),
                    message=f"node {node} cut off from the rendezvous at {endpoint} for "
                            f"{seconds:.0f}s: stopping it and its workers")
        events.emit("exit", who="agent", node=node, code=EXIT_ISOLATED, message="isolated from the rendezvous")
        os._exit(EXIT_ISOLATED)

    return act
