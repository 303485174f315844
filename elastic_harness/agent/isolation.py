"""Agent-side isolation watchdog: an agent cut off from the rendezvous takes itself down.

A partitioned agent was seen blocked for over 13 minutes in ``recvfrom`` on its store
socket, ignoring SIGTERM. This thread probes the rendezvous (a TCP connect, which works for
the c10d store and for etcd alike) every ``interval`` seconds. Its clock starts only once
a probe first succeeded: an agent started before the c10d host (or etcd) is waiting to
join, which ``rendezvous.join_timeout`` bounds, not cut off. After that, ``limit`` seconds
without one success end the agent process with ``os._exit`` (which no blocked call can
stop); its workers die with it (``PR_SET_PDEATHSIG``), so a node that comes back after a
partition writes nothing more into the job's checkpoints, and a fresh agent can rejoin.

etcd: the client fails over between the members the endpoint names (``rendezvous.etcd_gateway``;
torch's etcd-v2 client, python-etcd, to every member the cluster advertises), so one success
among all members counts (``etcd_members`` adds those the cluster advertises); losing the
member named first in the endpoint does not isolate anyone.

A partition may cut the shared run directory too: the ``isolated`` and ``exit`` events are
written within ``write_budget_s`` or not at all before the process exits.

Call order: ``watch(...)`` (or ``IsolationWatchdog(...).start()``) once the agent is set up;
``stop()`` when the agent ends normally.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from elastic_harness import exitcodes
from elastic_harness.spec import backends

EXIT_ISOLATED = exitcodes.INFRA  # cut off from the rendezvous: the infrastructure's failure, retry
MEMBERS_REFRESH_S = 60.0  # etcd membership changes rarely: ask again this often


def reachable(host: str, port: int, timeout: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def isolated_for(last_ok: float | None, now: float, limit: float) -> bool:
    """Pure: cut off for longer than ``limit``? Never before the first success (``None``)."""
    return last_ok is not None and now - last_ok > limit


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` -> (host, port)."""
    host, _, port = endpoint.strip().rpartition(":")
    return host.strip("[]"), int(port)


def etcd_members(endpoint: str, conf: dict | None = None, timeout: float = 2.0) -> list[str]:
    """Client endpoints (``HOST:PORT``) every member of the etcd cluster advertises (its v3
    member list, which etcd-v2 clusters serve too); [] when etcd cannot be asked right now.
    ``conf``: the rendezvous config (TLS, user; ``launch.config.rdzv_configs``)."""
    from elastic_harness.rendezvous import etcd_gateway

    conf = dict(conf or {})
    try:
        password = Path(conf["password_file"]).read_text().rstrip("\r\n") if conf.get("password_file") else ""
        settings = etcd_gateway.Settings.from_conf(endpoint, {**conf, "read_timeout": timeout, "isolation_timeout": 0},
                                                   password)  # asked, not waited for
        gateway = etcd_gateway.Gateway(settings)
        try:
            return gateway.members()
        finally:
            gateway.close()
    except (etcd_gateway.EtcdError, OSError, ValueError, KeyError):
        return []


class IsolationWatchdog:
    """``members``: optional, more endpoints of the same rendezvous (asked after a success)."""

    def __init__(self, endpoint: str, limit: float, on_isolated: Callable[[float], None],
                 interval: float = 1.0, probe: Callable[[str, int, float], bool] = reachable,
                 members: Callable[[], Sequence[str]] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.endpoints = [e for e in endpoint.split(",") if e.strip()]
        self.limit, self.interval = limit, interval
        self.on_isolated, self.probe, self.members, self.clock = on_isolated, probe, members, clock
        self._members_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="isolation-watchdog", daemon=True)

    def start(self) -> IsolationWatchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def probe_all(self) -> bool:
        """One round: is any endpoint of the rendezvous reachable?"""
        timeout = min(2.0, self.limit / 2)
        return any(self.probe(*split_endpoint(e), timeout) for e in self.endpoints)

    def _learn_members(self) -> None:
        now = self.clock()
        if self.members is None or (self._members_at is not None and now - self._members_at < MEMBERS_REFRESH_S):
            return
        found = list(self.members())
        if found:  # keep what was configured; add what the cluster advertises
            self._members_at = now
            self.endpoints = list(dict.fromkeys([*self.endpoints, *found]))

    def _run(self) -> None:
        last_ok = None
        while not self._stop.wait(self.interval):
            if self.probe_all():
                last_ok = self.clock()
                self._learn_members()
            elif isolated_for(last_ok, self.clock(), self.limit):
                self.on_isolated(self.clock() - last_ok)
                return


def exit_isolated(events, node: str, endpoint: str, write_budget_s: float = 2.0,
                  exit: Callable[[int], object] = os._exit) -> Callable[[float], None]:
    """What an isolated agent does: say so (within ``write_budget_s``), then ``exit``."""

    def act(seconds: float) -> None:
        message = (f"node {node} cut off from the rendezvous at {endpoint} for {seconds:.0f}s: "
                   "stopping it and its workers")

        def say() -> None:
            print(f"error: {message}", file=sys.stderr, flush=True)
            events.emit("isolated", node=node, endpoint=endpoint, seconds=round(seconds, 2), message=message)
            events.emit("exit", who="agent", node=node, code=EXIT_ISOLATED, message="isolated from the rendezvous")

        # A partition can hang the shared run dir (and a log file on it): never wait longer.
        writer = threading.Thread(target=say, name="isolated-report", daemon=True)
        writer.start()
        writer.join(write_budget_s)
        exit(EXIT_ISOLATED)

    return act


def watch(spec, opts, events, node: str) -> IsolationWatchdog | None:
    """The agent's watchdog as the job asks for it, started; None when
    ``rendezvous.isolation_timeout`` is 0. ``opts``: the agent's ``NodeOptions``."""
    limit = spec.rendezvous.isolation_timeout
    if not limit:
        return None
    members = None
    if not backends.BY_TORCH_NAME[opts.rdzv_backend].hosts_store:  # etcd: every member the client could fail over to
        from elastic_harness.launch.config import rdzv_configs

        conf = rdzv_configs(spec, opts)

        def members() -> list[str]:
            return etcd_members(opts.rdzv_endpoint, conf)

    act = exit_isolated(events, node, opts.rdzv_endpoint)
    return IsolationWatchdog(opts.rdzv_endpoint, limit, act, members=members).start()
