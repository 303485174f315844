"""Show a running job's events on the terminal (fed by ``events.EventTail``)."""

from __future__ import annotations

import sys
from typing import TextIO

from elastic_harness.runstate import RunState


class Progress:
    """A one-line bar on a terminal; plain lines (notable events, every 10%) otherwise.

    Counts come from ``runstate.RunState`` fed with the same events, so the bar and the
    final line (``summary.json``) agree. Feed it this invocation's events, in order.
    """

    def __init__(self, total_steps: int, out: TextIO = sys.stderr) -> None:
        self.total = total_steps
        self.out = out
        self.tty = out.isatty()
        self.state = RunState()
        self._last_decile = -1

    def update(self, e: dict) -> None:
        self.state.update(e)
        kind = e["event"]
        if kind == "resume":
            self._line(e.get("message") or "starting fresh (no checkpoint found)")
        elif kind == "step":
            self._step(e)
        elif kind == "memory" and e.get("copy_s"):  # not the first, unmeasured setting
            self._line(f"in-memory snapshots every {e['every']} step(s) from step {e['step']} "
                       f"(a copy takes {1000 * e['copy_s']:.1f} ms, a step {1000 * e['step_s']:.1f} ms)")
        elif kind == "failure" and e.get("fatal"):
            return  # the host prints it once, as the error
        elif kind in ("checkpoint", "warning", "failure", "fault", "drain", "eval", "quarantine",
                      "skipped", "fenced"):
            self._line(_describe(e))

    def _step(self, e: dict) -> None:
        pct = e["step"] / self.total
        width = 24
        bar = "#" * int(pct * width) + "-" * (width - int(pct * width))
        text = (f"[{bar}] step {e['step']}/{self.total} loss {e['loss']:.4f} "
                f"{e.get('samples_per_s') or 0:.0f} samples/s world {e['world_size']} "
                f"restarts {self.state.restarts}")
        if self.tty:
            self.out.write("\r" + text)
            self.out.flush()
        elif int(pct * 10) != self._last_decile:
            self._last_decile = int(pct * 10)
            self.out.write(text + "\n")

    def _line(self, text: str) -> None:
        self.out.write(("\r\033[K" if self.tty else "") + text + "\n")
        self.out.flush()

    def close(self) -> None:
        if self.tty:
            self.out.write("\n")


def _describe(e: dict) -> str:
    kind = e["event"]
    if kind == "checkpoint":
        mode = "async" if e.get("asynchronous") else "sync"
        return f"checkpoint step {e['step']} ({mode}, blocked {e['blocking_s']:.2f} s, total {e['total_s']:.2f} s)"
    if kind == "fault":
        return f"fault: {e.get('kind')} target {e.get('target')} at step {e.get('step')}"
    if kind == "drain":
        return f"drained at step {e['step']} (state saved)"
    if kind == "eval":
        values = " ".join(f"{k} {v:.4g}" for k, v in sorted(e.get("metrics", {}).items()))
        return f"eval at step {e['step']}: {values}"
    return f"{kind}: {e.get('message', '')}"
