"""Show a running job's events on the terminal (fed by ``events.EventTail``)."""

from __future__ import annotations

import contextlib
import re
import sys
from typing import TextIO

from elastic_harness.records.runstate import RunState

# A durable save is worth its own line only when it held training up this long; the rest
# are folded into the progress line ("saved 100") and the closing tally.
SLOW_SAVE_S = 1.0
# A new in-memory snapshot interval is printed once it held this many steps.
SETTLE_STEPS = 50
# The rendezvous' own line when it drops a lost node (``rendezvous.handler._Handler.drop_dead``):
# the node's name is torch's ``ADDR_PID_LOCALID`` of its agent, the reason follows the colon.
_DROPPED = re.compile(r"Dropping node '(?P<name>[^']*?_(?P<pid>\d+)_\d+)' .*?: (?P<why>.*)$")


class Progress:
    """A one-line bar on a terminal; plain lines (notable events, every 10%) otherwise.

    Quiet by design: the bar (or, off a terminal, a line every 10%) carries the last durable
    checkpoint's step; only unusual events get their own line (faults, failures, warnings,
    drains, evaluations, a save that blocked training over ``SLOW_SAVE_S``, a new in-memory
    snapshot interval), and ``close`` tallies the saves. Counts come from
    ``runstate.RunState`` fed with the same events, so the bar and the final line
    (``summary.json``) agree. Feed it this invocation's events, in order.
    """

    def __init__(self, total_steps: int, out: TextIO = sys.stderr, step_timeout: float = 0.0) -> None:
        self.total = total_steps
        self.out = out
        self.step_timeout = step_timeout  # timeouts.step (0: the watchdog is off), for ``_slow_step``
        self.tty = out.isatty()
        self.state = RunState()
        self._last_decile = -1
        self._every_shown: int | None = None  # the snapshot interval last printed
        self._every_pending: dict | None = None  # a new one, printed once it settled
        self._saves: list[dict] = []
        self._agents: dict[int, set[str]] = {}  # agent pid -> its node(s), from the agents' own events
        self._dropped: set[str] = set()  # nodes whose loss was said (torch's node names)
        self._symptom_said = False  # since the last restore, a node's "lost its peers" was said
        self._symptom: str | None = None  # that line, held until the recovery ends or the cause is known
        self._spares: dict[str, float] = {}  # hot spare node -> when it was started (the `spares` event)
        self._spares_said: set[tuple[str, str]] = set()  # (node, "ready" | "took")
        self._gone: list[str] = []  # nodes said gone since the last restore
        self._slow_said = False  # timeouts.step below a measured step time was said

    def update(self, e: dict) -> None:
        self.state.update(e)
        with contextlib.suppress(KeyError, TypeError, ValueError):  # a field of another shape: not shown
            self._show(e)

    def _show(self, e: dict) -> None:
        kind = e["event"]
        if kind in ("workers", "torchelastic") and e.get("node") is not None:
            self._agents.setdefault(int(e["pid"]), set()).add(str(e["node"]))
        if kind == "torchelastic":
            self._node_dropped(e)
            self._spare(e)
        elif kind == "spares":
            self._spares.update({str(n): float(e["t"]) for n in e.get("nodes") or ()})
        elif kind == "worker":
            self._spare(e)
        elif kind == "resume":
            self._say_symptom()
            self._symptom_said, self._gone = False, []
            self._line(e.get("message") or "starting fresh (no checkpoint found)")
        elif kind == "recovery":
            self._line(recovered_line(e))
        elif kind == "finished":
            self._line(e.get("message") or f"step {e.get('step')} finished in place")
        elif kind == "workers" and e.get("state") == "unparked":
            self._line(f"node {e.get('node')}: a worker did not leave its step in time; it is started anew")
        elif kind == "step":
            self._settle(e["step"])
            self._slow_step(e)
            self._step(e)
        elif kind == "memory":
            self._memory(e)
        elif kind == "checkpoint":
            self._saves.append(e)
            if (e.get("blocking_s") or 0) > SLOW_SAVE_S:
                self._line(_describe(e))
        elif kind == "failure":
            self._failure(e)
        elif kind in ("warning", "fault", "drain", "eval", "quarantine", "skipped", "fenced"):
            self._line(_describe(e))

    def _failure(self, e: dict) -> None:
        """A ``failure``: the cause is said, a symptom is held (``_say_symptom``), the rest
        is said elsewhere."""
        if e.get("fatal") or (e.get("consecutive") or 0) > 1 or not _cause_first(e):
            return  # the host's error says it; failed saves in a row: the first is said; a symptom
        symptom = (e.get("cause") is None and _timed_out(e)) or (e.get("cause") == "exit" and e.get("peer_lost"))
        if symptom:  # a survivor's words (a peer timed out, lost its peers): once, and only if the
            if not self._symptom_said:  # cause is not known by the time the job recovered
                self._symptom_said, self._symptom = True, _describe(e)
            return
        if " hung" in str(e.get("message", "")):
            self._symptom_said, self._symptom = True, None  # the cause: a survivor's timeout is not
        self._line(_describe(e))

    def _node_dropped(self, e: dict) -> None:
        """"node 1 is gone (its agent's process is gone, ...)", once per node: the rendezvous
        dropped it without waiting for its keep-alives (a node loss has no agent left to say
        so itself; its peers' "lost its peers" is the symptom)."""
        found = _DROPPED.search(str(e.get("message", "")))
        if not found or found["name"] in self._dropped:
            return
        self._dropped.add(found["name"])
        nodes = self._agents.get(int(found["pid"]), set())  # simulated hosts may share pids: then torch's name
        who = next(iter(nodes)) if len(nodes) == 1 else found["name"]
        self._symptom_said, self._symptom = True, None  # the cause is known: the survivors' words are not
        self._gone.append(who)
        self._line(f"node {who} is gone ({found['why'].rstrip('.')})")

    def _slow_step(self, e: dict) -> None:
        """Once: ``timeouts.step`` below a step's measured time (the watchdog would stop
        workers as hung whenever a step takes that long)."""
        took = e.get("step_s") or 0.0
        if self.step_timeout and took > self.step_timeout and not self._slow_said:
            self._slow_said = True
            self._line(f"warning: timeouts.step={self.step_timeout:g}s is below the measured step time "
                       f"({took:.3g}s at step {e['step']}): the step watchdog stops a worker as hung whenever a "
                       "step takes longer; raise timeouts.step well above it (0 turns the watchdog off)")

    def _say_symptom(self) -> None:
        """A survivor's "lost its peers", held back (``_show``): said when nothing named the
        cause before the recovery ended (or the run did)."""
        if self._symptom is not None:
            self._line(self._symptom)
            self._symptom = None

    def _spare(self, e: dict) -> None:
        """A hot spare's two moments, once each: it waits in the rendezvous, ready (torch's
        redundancy list), and its workers started in a group: it took a lost node's place."""
        node = str(e.get("node"))
        if node not in self._spares:
            return
        if e["event"] == "torchelastic" and "redundancy list" in str(e.get("message") or ""):
            self._say_spare(node, "ready", f"spare node {node} is ready ({e['t'] - self._spares[node]:.1f} s after "
                                           "it was started): it takes the place of the next node lost")
        elif e["event"] == "worker":
            whose = f"node {', '.join(self._gone)}'s" if self._gone else "a lost node's"
            self._say_spare(node, "took", f"spare node {node} took {whose} place (world size {e.get('world_size')})")

    def _say_spare(self, node: str, moment: str, text: str) -> None:
        if (node, moment) not in self._spares_said:
            self._spares_said.add((node, moment))
            self._line(text)

    def _memory(self, e: dict) -> None:
        """The snapshot interval once measured, then only when it settles on another value
        for ``SETTLE_STEPS`` (0, a memory probe's off block, is not a setting)."""
        every = e.get("every") or 0
        if not e.get("copy_s") or every <= 0:
            return  # the first, unmeasured setting; a probe block
        if every == self._every_shown:
            self._every_pending = None  # back to what is shown: nothing to say
        elif self._every_pending is None or self._every_pending["every"] != every:
            self._every_pending = e  # a new value: shown once it held (``_settle``)

    def _settle(self, step: int) -> None:
        e = self._every_pending
        if e is None or step - e["step"] < SETTLE_STEPS:
            return
        self._every_shown, self._every_pending = e["every"], None
        self._line(f"in-memory snapshots every {e['every']} step(s) from step {e['step']} "
                   f"(a copy takes {1000 * e['copy_s']:.1f} ms, a step {1000 * e['step_s']:.1f} ms)")

    def _step(self, e: dict) -> None:
        pct = e["step"] / self.total
        width = 24
        bar = "#" * int(pct * width) + "-" * (width - int(pct * width))
        saved = self.state.last_checkpoint_step
        loss = "-" if e.get("loss") is None else f"{e['loss']:.4f}"
        text = (f"[{bar}] step {e['step']}/{self.total} loss {loss} "
                f"{e.get('samples_per_s') or 0:.0f} samples/s world {e.get('world_size', '-')} "
                f"restarts {self.state.restarts}" + (f" saved {saved}" if saved is not None else ""))
        if self.tty:
            self.out.write("\r\033[K" + text)
            self.out.flush()
        elif int(pct * 10) != self._last_decile:
            self._last_decile = int(pct * 10)
            self.out.write(text + "\n")

    def _line(self, text: str) -> None:
        self.out.write(("\r\033[K" if self.tty else "") + text + "\n")
        self.out.flush()

    def close(self) -> None:
        self._say_symptom()
        if self.tty:
            self.out.write("\n")
        if self._saves:
            self._line(_tally(self._saves))


def recovered_line(e: dict) -> str:
    """Pure: the host's line for a ``recovery`` event (a generation entered in place)."""
    kept, new = len(e.get("kept") or []), len(e.get("new") or [])
    how = ("re-pointed at the new membership, nobody new" if e.get("mode") == "repoint"
           else f"ran the training function again beside {new} new worker(s)")
    return f"recovered in place: {kept} of {kept + new} workers kept their process ({how})"


def _cause_first(e: dict) -> bool:
    """Is a ``failure`` event the line to show? A survivor's "connection closed by peer" is a
    symptom: its agent's account (``cause: exit``) names the rank that died and how, first.
    That account is shown when no rank's own failure event said it: a rank killed by a signal
    or exiting without a record, or a node whose ranks only lost peers on another node."""
    if e.get("cause") == "exit":
        return not e.get("recorded") or bool(e.get("peer_lost"))
    return not e.get("peer_lost")


_TIMED_OUT = re.compile(r"timed out waiting", re.IGNORECASE)


def _timed_out(e: dict) -> bool:
    """A rank's own failure that is a collective timing out (gloo's "Timed out waiting ...ms
    for recv"): a symptom of a peer that stopped answering."""
    return bool(_TIMED_OUT.search(str(e.get("message", ""))))


def _tally(saves: list[dict]) -> str:
    """``checkpoints: 8 saved (async), last step 400, training blocked 0.01-0.03 s each``."""
    blocked = [e.get("blocking_s") or 0.0 for e in saves]
    modes = sorted({"async" if e.get("asynchronous") else "sync" for e in saves})
    held = f"{min(blocked):.2f}" if f"{min(blocked):.2f}" == f"{max(blocked):.2f}" else \
        f"{min(blocked):.2f}-{max(blocked):.2f}"
    return (f"checkpoints: {len(saves)} saved ({'/'.join(modes)}), last step {saves[-1]['step']}, "
            f"training blocked {held} s each")


def _describe(e: dict) -> str:
    kind = e["event"]
    if kind == "checkpoint":
        mode = "async" if e.get("asynchronous") else "sync"
        return (f"checkpoint step {e['step']} held training up {e['blocking_s']:.2f} s "
                f"({mode}, total {e['total_s']:.2f} s)")
    if kind == "fault":
        return f"fault: {e.get('kind')} target {e.get('target')} at step {e.get('step')}"
    if kind == "drain":
        return f"drained at step {e['step']} (state saved)"
    if kind == "eval":
        values = " ".join(f"{k} {v:.4g}" for k, v in sorted(e.get("metrics", {}).items()))
        return f"eval at step {e['step']}: {values}"
    return f"{kind}: {e.get('message', '')}"
