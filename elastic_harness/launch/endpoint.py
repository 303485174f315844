"""The agent's HTTP endpoint: ``/healthz``, ``/progress`` (JSON) and ``/metrics`` (Prometheus).

It follows the run's ``events.jsonl`` (the same account the CLI and report read), so it
needs nothing from the workers. It binds to loopback unless told otherwise (Kubernetes
probes need the pod address: ``--endpoint-host 0.0.0.0`` in the rendered manifests).

``ProgressState`` is pure (events in, numbers out); ``serve`` is the thin HTTP part.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from elastic_harness.events import EventTail


@dataclass
class ProgressState:
    step: int = 0
    loss: float | None = None
    world_size: int = 0
    restarts: int = 0
    last_checkpoint_step: int | None = None
    checkpoint_save_seconds: float = 0.0
    checkpoint_blocking_seconds: float = 0.0
    checkpoint_load_seconds: float = 0.0
    checkpoints: int = 0
    productive_seconds: float = 0.0
    started: float | None = None
    updated: float | None = None
    finished: bool = False
    _generations: int = 0

    def update(self, e: dict) -> None:
        kind, t = e.get("event"), e.get("t", 0.0)
        self.started = self.started if self.started is not None else t
        self.updated = t
        if kind == "step":
            self.step, self.loss, self.world_size = e["step"], e["loss"], e["world_size"]
            self.productive_seconds += e.get("step_s", 0.0)
        elif kind == "resume":
            self._generations += 1
            self.restarts = self._generations - 1
            self.checkpoint_load_seconds += e.get("load_s", 0.0)
            self.world_size = e.get("world_size", self.world_size)
        elif kind == "checkpoint":
            self.checkpoints += 1
            self.last_checkpoint_step = e["step"]
            self.checkpoint_save_seconds += e.get("total_s", 0.0)
            self.checkpoint_blocking_seconds += e.get("blocking_s", 0.0)
        elif kind == "finish":
            self.finished = True

    def goodput(self, now: float) -> float:
        wall = now - self.started if self.started is not None else 0.0
        return self.productive_seconds / wall if wall > 0 else 0.0

    def progress(self, now: float) -> dict:
        out = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        out["goodput"] = round(self.goodput(now), 4)
        return out

    def metrics(self, now: float) -> str:
        rows = [
            ("steps_total", "counter", "Optimizer steps completed", self.step),
            ("restarts_total", "counter", "Worker-group restarts seen", self.restarts),
            ("world_size", "gauge", "Ranks in the current worker group", self.world_size),
            ("goodput_ratio", "gauge", "Productive step time / wall time", round(self.goodput(now), 6)),
            ("checkpoints_total", "counter", "Checkpoints committed", self.checkpoints),
            ("checkpoint_save_seconds_total", "counter", "Seconds spent saving (total)",
             round(self.checkpoint_save_seconds, 6)),
            ("checkpoint_blocking_seconds_total", "counter", "Seconds training blocked on saves",
             round(self.checkpoint_blocking_seconds, 6)),
            ("checkpoint_load_seconds_total", "counter", "Seconds spent loading checkpoints",
             round(self.checkpoint_load_seconds, 6)),
        ]
        lines = []
        for name, kind, help_text, value in rows:
            full = f"elastic_harness_{name}"
            lines += [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}", f"{full} {value}"]
        return "\n".join(lines) + "\n"


class Endpoint:
    """Serves a ``ProgressState`` fed from ``events.jsonl``; ``close()`` is idempotent."""

    def __init__(self, run_dir: Path, host: str, port: int) -> None:
        self.state = ProgressState()
        self._tail = EventTail(Path(run_dir) / "events.jsonl", start_at_end=False)
        self._lock = threading.Lock()
        state, refresh = self.state, self._refresh

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                refresh()
                now = time.time()
                if self.path == "/healthz":
                    self._send(200, "text/plain", "ok\n")
                elif self.path == "/progress":
                    self._send(200, "application/json", json.dumps(state.progress(now)) + "\n")
                elif self.path == "/metrics":
                    self._send(200, "text/plain; version=0.0.4", state.metrics(now))
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
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self._closed = False

    def _refresh(self) -> None:
        with self._lock:
            for e in self._tail.read():
                self.state.update(e)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._server.shutdown()
            self._server.server_close()
