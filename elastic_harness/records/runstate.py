"""Pure: the one fold of the event log. Events in, ``RunState`` out.

``summary.json``, the ``run`` progress line, the agent endpoint and ``report`` all read a
run through this fold, so restarts, steps and goodput are counted one way:

- **generations**: worker groups started; one ``worker`` event of global rank 0 each (with
  ``node`` set: one of that node's local rank 0, so a node counts the groups it was in).
  **restarts** = generations - 1, whatever the cause (failure, lost node, new node).
- **steps_done**: optimizer steps completed, redone ones included (a counter that only goes
  up); **step** is the newest step number (it goes back when a generation resumes).
- **faults**: ``fault`` events (with ``node`` set: those that hit that node).
- **recoveries**: generations that resumed from a checkpoint (``resume`` events that are
  not fresh): how often lost or interrupted work was picked up again.
- **nodes**: nodes in the newest worker group (its ``rendezvous`` event).
- **goodput**: ``goodput.GoodputLedger`` (the definitions live there).

Call order: ``update(e)`` per event, in order; read the attributes or ``goodput(now)`` at
any time. ``fold(events)`` does it for a whole log, each invocation sorted by time (what
``report`` and ``summary.json`` use). Which events to feed is the caller's: one invocation
(``current_invocation``), a whole run dir, or what a reader saw since it started.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from elastic_harness.records.goodput import Goodput, GoodputLedger


def split_invocations(events: Sequence[dict]) -> list[list[dict]]:
    """Events cut at each host ``start``, each part sorted by time."""
    parts: list[list[dict]] = []
    for e in events:
        if not parts or (_host_start(e) and parts[-1]):
            parts.append([])
        parts[-1].append(e)
    return [sorted(p, key=lambda e: e["t"]) for p in parts]


def current_invocation(events: Sequence[dict]) -> list[dict]:
    """Events since the last host ``start`` (a run dir accumulates invocations)."""
    starts = [i for i, e in enumerate(events) if _host_start(e)]
    return list(events[starts[-1]:]) if starts else list(events)


def _host_start(e: dict) -> bool:
    return e.get("event") == "start" and e.get("who") == "host"


class RunState:
    """What a run has done so far (module doc). ``node``: count generations and faults of
    that node only (the agent endpoint's view); None: the whole job's."""

    def __init__(self, node: str | None = None) -> None:
        self.node = node
        self.ledger = GoodputLedger()
        self.first_t: float | None = None
        self.last_t: float | None = None
        self.step = 0
        self.steps_done = 0
        self.loss: float | None = None
        self.first_loss: float | None = None
        self.world_size = 0
        self.world_sizes: list[int] = []  # of each worker group, repeats collapsed
        self.nodes = 0  # in the newest worker group
        self.recoveries = 0  # resumes from a checkpoint
        self.samples = 0
        self.generations = 0
        self.resumed_from_step: int | None = None  # of the first resume; None when it was fresh
        self.faults = 0
        self.checkpoints = 0
        self.last_checkpoint: str | None = None
        self.last_checkpoint_step: int | None = None
        self.failures: list[str] = []
        self.drained_at: int | None = None  # the step of the newest drain
        self.agent_exits: list[tuple[int, str]] = []  # (code, message) of each agent's exit
        self.run_id: str | None = None  # the invocation's rendezvous id (its host's ``start``)
        self._agents: set[int] = set()  # pids of the agents that started with it
        self.finished = False
        self.superseded: str = ""  # a fenced generation finished: why its result is not saved
        self._fenced: dict[int, int] = {}  # rank 0 pid of a fenced generation -> saves refused
        self.digest: str | None = None
        self._resumes = 0
        self._gen_step: dict[int, int] = {}  # rank 0 pid -> its last step (for steps_done)

    @property
    def restarts(self) -> int:
        return max(0, self.generations - 1)

    def goodput(self, now: float | None = None) -> Goodput:
        return self.ledger.goodput(now)

    def update(self, e: dict) -> None:
        self.ledger.update(e)
        t = e.get("t")
        if t is not None:
            self.first_t = t if self.first_t is None else self.first_t
            self.last_t = t
        handler = _HANDLERS.get(e.get("event"))
        if handler is not None:
            handler(self, e)

    def _worker(self, e: dict) -> None:
        mine = e.get("rank") == 0 if self.node is None else (
            str(e.get("node")) == self.node and e.get("local_rank") == 0)
        self.generations += int(mine)

    def _rendezvous(self, e: dict) -> None:
        self.world_size = e.get("world_size", self.world_size)
        self.nodes = e.get("nodes", self.nodes)
        if not self.world_sizes or self.world_sizes[-1] != self.world_size:
            self.world_sizes.append(self.world_size)

    def _resume(self, e: dict) -> None:
        self._resumes += 1
        self.recoveries += int(not e.get("fresh"))
        if self._resumes == 1 and not e.get("fresh"):
            self.resumed_from_step = e.get("step")
        self.step = int(e.get("step") or 0)
        self._gen_step[e.get("pid", 0)] = self.step
        self.world_size = e.get("world_size", self.world_size)

    def _step(self, e: dict) -> None:
        pid, step = e.get("pid", 0), int(e["step"])
        self.steps_done += max(0, step - self._gen_step.get(pid, step - 1))
        self._gen_step[pid] = step
        self.step, self.loss = step, e.get("loss")
        self.first_loss = self.loss if self.first_loss is None else self.first_loss
        self.world_size = e.get("world_size", self.world_size)
        self.samples = e.get("samples", self.samples)

    def _checkpoint(self, e: dict) -> None:
        self.checkpoints += 1
        self.last_checkpoint, self.last_checkpoint_step = e.get("path"), e.get("step")

    def _fault(self, e: dict) -> None:
        self.faults += int(self.node is None or str(e.get("node")) == self.node)

    def _failure(self, e: dict) -> None:
        self.failures.append(e.get("message", ""))

    def _drain(self, e: dict) -> None:
        self.drained_at = e.get("step")

    def _start(self, e: dict) -> None:
        if e.get("who") == "host":
            self.run_id = e.get("run_id")
        elif e.get("who") == "agent" and e.get("run_id") == self.run_id:
            self._agents.add(e.get("pid", 0))

    def _exit(self, e: dict) -> None:
        # Another submission's agent may share the log: one whose lock this one took over
        # (``checkpoint.lock``) ends while this one runs; its exit is not this job's.
        theirs = self.run_id is not None and e.get("pid", 0) not in self._agents
        if e.get("who") == "agent" and not theirs:
            self.agent_exits.append((int(e.get("code") or 0), e.get("message") or ""))

    def _fenced_save(self, e: dict) -> None:
        pid = e.get("pid", 0)
        self._fenced[pid] = self._fenced.get(pid, 0) + 1

    def _finish(self, e: dict) -> None:
        refused = self._fenced.get(e.get("pid", 0), 0)
        if refused:  # a superseded generation: its saves, the final one included, were refused
            self.superseded = (f"the workers reached step {e['step']}, but their generation had been superseded "
                               f"by a newer one on the same checkpoint directory and {refused} of its saves "
                               "were refused (the fence): its result is not saved")
            return
        self.finished = True
        self.step, self.loss, self.digest = e["step"], e.get("loss"), e.get("digest")
        self.samples = e.get("samples", self.samples)


_HANDLERS = {
    "worker": RunState._worker, "rendezvous": RunState._rendezvous, "resume": RunState._resume,
    "step": RunState._step, "checkpoint": RunState._checkpoint, "fault": RunState._fault,
    "failure": RunState._failure, "finish": RunState._finish, "drain": RunState._drain,
    "exit": RunState._exit, "fenced": RunState._fenced_save, "start": RunState._start,
}


def fold(events: Iterable[dict], node: str | None = None) -> RunState:
    """The whole log folded, each invocation in time order (see ``split_invocations``)."""
    state = RunState(node)
    for part in split_invocations(list(events)):
        for e in part:
            state.update(e)
    return state
