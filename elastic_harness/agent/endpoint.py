"""One node's HTTP endpoint: ``/healthz``, ``/progress`` (JSON) and ``/metrics`` (Prometheus).

What it shows is this node's view of the run since its agent started: a ``RunState``
(``runstate``, the fold every reader shares) scoped to ``node`` and fed with the events
appended to ``events.jsonl`` after the endpoint started. Restarts and faults are this
node's; step, world size and goodput are the job's as seen during this agent's life.

Three parts, so that no request ever waits on storage:

- a reader thread follows the log with ``events.EventTail`` (only new bytes) every
  ``refresh_s`` and folds what it read under a short lock;
- requests format the folded state (no I/O);
- the server is bounded: at most ``max_connections`` connections at once (more are closed
  at accept, not queued on a thread each), and each waits at most ``idle_timeout_s`` for its
  request, so idle connections do not hold threads.

``/healthz`` answers 200 ``ok`` or 503 with the reason (``health_verdict``): unhealthy when
the agent says so (``health``, e.g. its workers are stuck or failed), or when the log has
shown no new event for longer than ``stall_s`` while the job is not finished. A read that
is itself still in progress is not a stall: slow storage must not get a healthy pod killed.
``stall_bound(spec)`` is the documented default for ``stall_s``.

Call order: ``Endpoint(...)`` starts both threads; ``agent_health`` may be set at any
time after (a callable, called on each ``/healthz`` from a server thread: fast, thread-safe,
never blocking); ``close()`` stops both threads (idempotent).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from elastic_harness.events import EventTail
from elastic_harness.records.runstate import RunState

Health = Callable[[], tuple[bool, str]]


def stall_bound(spec) -> float | None:
    """Seconds without any new event that ``/healthz`` reads as a stuck node, or None (off).

    The longest quiet a healthy job has: waiting for nodes (``rendezvous.join_timeout``),
    forming the process group or a blocked save (``timeouts.process_group``), a drain
    (``timeouts.shutdown_grace``) and ``train.log_every`` steps between step events, each
    within ``timeouts.step``. With ``timeouts.step: 0`` steps are unbounded, so is this.
    Loading a checkpoint longer than the whole bound also reads as stuck.
    """
    if not spec.timeouts.step:
        return None
    t = spec.timeouts
    return float(spec.rendezvous.join_timeout + t.process_group + t.shutdown_grace
                 + spec.train.log_every * t.step)


def health_verdict(agent: tuple[bool, str] | None, quiet_s: float, stall_s: float | None,
                   finished: bool) -> tuple[bool, str]:
    """Pure: healthy or not, and why. ``quiet_s``: seconds since the log last grew (as read)."""
    if agent is not None and not agent[0]:
        return False, f"agent: {agent[1]}"
    if stall_s is not None and not finished and quiet_s > stall_s:
        return False, f"no new event for {quiet_s:.0f}s (bound {stall_s:.0f}s)"
    return True, agent[1] if agent is not None and agent[1] else "ok"


class _View:
    """The folded state behind one lock, plus what the reader has seen (monotonic times)."""

    def __init__(self, node: str, clock: Callable[[], float]) -> None:
        self.state = RunState(node)
        self.lock = threading.Lock()
        self.clock = clock
        self.last_growth = clock()  # the log last grew (or the endpoint started)
        self.read_started: float | None = None  # a read in progress since then

    def quiet_s(self) -> float:
        now = self.clock()
        if self.read_started is not None:
            return min(now - self.last_growth, self.read_started - self.last_growth)
        return now - self.last_growth


class _Collector:
    """prometheus_client custom collector: this node's numbers at scrape time."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint

    def collect(self):
        e = self.endpoint
        labels = ["job", "node"]
        with e.view.lock:
            s = e.view.state
            values = [
                (CounterMetricFamily, "elastic_harness_steps",
                 "Optimizer steps the job completed while this agent ran (redone ones included)", s.steps_done),
                (CounterMetricFamily, "elastic_harness_restarts",
                 "Worker-group restarts on this node, any cause", s.restarts),
                (CounterMetricFamily, "elastic_harness_faults", "Injected faults that hit this node", s.faults),
                (GaugeMetricFamily, "elastic_harness_step", "Newest optimizer step of the job", s.step),
                (GaugeMetricFamily, "elastic_harness_world_size", "Ranks in the current worker group",
                 s.world_size),
                (GaugeMetricFamily, "elastic_harness_goodput_ratio",
                 "Productive time / wall time while this agent ran (report's definition)",
                 s.goodput(e.wall_clock()).goodput),
            ]
        healthy = e.health_now()[0]
        for family, name, text, value in [*values, (GaugeMetricFamily, "elastic_harness_healthy",
                                                    "1 when /healthz answers 200", int(healthy))]:
            metric = family(name, text, labels=labels)
            metric.add_metric([e.job, e.node], value)
            yield metric


@dataclasses.dataclass(frozen=True)
class Serving:
    """How an ``Endpoint`` serves and reads: the address it listens on (port 0: any free
    one), ``stall_s`` (None: no stall verdict), ``refresh_s``, ``max_connections`` and
    ``idle_timeout_s`` as the module says, and its clocks (monotonic for ages, wall for times)."""

    host: str = "127.0.0.1"
    port: int = 0
    stall_s: float | None = None
    refresh_s: float = 1.0
    max_connections: int = 8
    idle_timeout_s: float = 5.0
    clock: Callable[[], float] = time.monotonic
    wall_clock: Callable[[], float] = time.time


class Endpoint:
    def __init__(self, events_path: Path, *, job: str, node: str, health: Health | None = None,
                 serving: Serving = Serving()) -> None:
        self.job, self.node = job, node
        self.agent_health, self.stall_s = health, serving.stall_s
        self.wall_clock, self.refresh_s = serving.wall_clock, serving.refresh_s
        self.view = _View(node, serving.clock)
        self._tail = EventTail(Path(events_path), start_at_end=True)
        self._reading = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._follow, name="endpoint-reader", daemon=True)
        self._server = _BoundedServer((serving.host, serving.port), _handler(self, serving.idle_timeout_s),
                                      serving.max_connections)
        self.port = self._server.server_address[1]
        self._serving = threading.Thread(target=self._server.serve_forever, name="endpoint", daemon=True)
        self._reader.start()
        self._serving.start()
        self._closed = False

    def refresh(self) -> None:
        """Fold what was appended since the last read (the reader thread calls this)."""
        with self._reading:  # one reader of the tail at a time, folding in file order
            self.view.read_started = self.view.clock()
            try:
                events = self._tail.read()
            finally:
                self.view.read_started = None
            if events:
                self._fold(events)

    def _fold(self, events: list[dict]) -> None:
        with self.view.lock:
            for e in events:
                try:
                    self.view.state.update(e)
                except (KeyError, TypeError, ValueError):
                    continue  # a line that breaks the contract: skip it, keep following
            self.view.last_growth = self.view.clock()

    def _follow(self) -> None:
        while True:
            with contextlib.suppress(OSError):  # unreadable for now: try again next round
                self.refresh()
            if self._stop.wait(self.refresh_s):
                return

    def health_now(self) -> tuple[bool, str]:
        agent = self.agent_health() if self.agent_health is not None else None
        with self.view.lock:
            finished = self.view.state.finished
        return health_verdict(agent, self.view.quiet_s(), self.stall_s, finished)

    def progress(self) -> dict:
        ok, reason = self.health_now()
        with self.view.lock:
            s = self.view.state
            g = s.goodput(self.wall_clock())
            return {
                "job": self.job, "node": self.node, "healthy": ok, "health": reason,
                "step": s.step, "steps_done": s.steps_done, "loss": s.loss, "world_size": s.world_size,
                "restarts": s.restarts, "faults": s.faults, "checkpoints": s.checkpoints,
                "last_checkpoint_step": s.last_checkpoint_step, "finished": s.finished,
                "goodput": g.goodput, "productive_s": g.productive_s, "wall_s": g.wall_s,
                "badput": g.badput, "updated": s.last_t,
            }

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._stop.set()
            self._server.shutdown()
            self._server.server_close()
            self._reader.join(timeout=2.0)  # a read hung on storage must not hold up the exit


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, but at most ``max_connections`` at once (module doc)."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, address: tuple[str, int], handler: type, max_connections: int) -> None:
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # full: close it now rather than queue a thread
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def _handler(endpoint: Endpoint, idle_timeout_s: float) -> type:
    class Handler(BaseHTTPRequestHandler):
        timeout = idle_timeout_s  # socket timeout: an idle or slow client is dropped

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path == "/healthz":
                ok, reason = endpoint.health_now()
                self._send(200 if ok else 503, "text/plain", ("ok" if ok else reason) + "\n")
            elif self.path == "/progress":
                self._send(200, "application/json", json.dumps(endpoint.progress()) + "\n")
            elif self.path == "/metrics":
                self._send(200, CONTENT_TYPE_LATEST, generate_latest(endpoint.registry).decode())
            else:
                self._send(404, "text/plain", "not found\n")

        def _send(self, code: int, ctype: str, body: str) -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass  # probes every few seconds would flood the agent's log

    return Handler
