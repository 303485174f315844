"""Run one elastic agent (one node) in this process: torchelastic's agent (``agent.elastic``).

Exit codes (documented for schedulers):
  0    every worker finished the job;
  143  the agent was preempted (SIGTERM; 128 + signal number for other signals), so
       schedulers that retry only codes >= 128 (Kubeflow's ExitCode policy) retry it;
  2    a mistake the user must fix, do not retry: a fatal error in a worker (incompatible
       checkpoint, bad input), a crash loop (the same error at the same step twice), or a
       rendezvous id that is closed (a finished job's);
  200  the infrastructure failed, retry (``exitcodes.INFRA``): too few nodes within
       ``rendezvous.join_timeout``, rendezvous host lost, another rendezvous error;
  1    workers failed more than ``max_restarts`` times (see ``exitcodes``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastic_harness import exitcodes, runfiles
from elastic_harness.agent import bridge, isolation
from elastic_harness.errors import LockLost
from elastic_harness.events import EventLog, EventTail
from elastic_harness.launch.config import NodeOptions, launch_config, worker_command
from elastic_harness.launch.env import AGENT_PID_VAR, JOB_VAR, MEMORY_VAR, NODE_VAR, RUN_DIR_VAR
from elastic_harness.launch.policy import exhausted_message, finish_bound_s, stop_reason
from elastic_harness.memtier.host import BUDDY_SLOTS, SLOTS_PER_RANK, HostSlots
from elastic_harness.rendezvous.exclusion import HANG_WORDS
from elastic_harness.spec import JobSpec, backends

EXIT_OK, EXIT_FAILED, EXIT_PERMANENT = exitcodes.OK, exitcodes.FAILED, exitcodes.PERMANENT
EXIT_INFRA = exitcodes.INFRA


ZYGOTE_READY_S = 300.0  # at most this long for the zygote's imports before joining anyway
# In place, how long a survivor may take to leave its step (reach a harness call) when the
# step watchdog is off (``timeouts.step: 0``); else ``timeouts.step``: a worker that does not
# reach one within it is hung.
PARK_BOUND_S = 60.0


def run_agent(spec: JobSpec, opts: NodeOptions, node: str = "",
              on_health: Callable[[Callable[[], tuple[bool, str]]], None] | None = None,
              zygote: Any = None, lock_lost: Callable[[bool], str] | None = None) -> int:
    """Run this node's agent to the end; its exit code. ``on_health`` receives the agent's
    health callable (for the endpoint's ``/healthz``) once the agent exists. ``zygote``: a
    started ``agent.zygote.Zygote`` for warm starts (``spec.warm_start``), or None; the
    caller starts it before anything imports torch, so that its imports overlap this
    process's (``commands.agent``), and stops it. ``lock_lost(now)``: why this submission
    no longer holds the run directory ("" while it does: ``rundir.Claim.lost``)."""
    run_dir = Path(opts.run_dir)
    entrypoint, args = worker_command(run_dir)
    # Workers inherit the agent's environment: their node, job and run dir.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # see launch.config.agent_environ
    os.environ.update({NODE_VAR: node, JOB_VAR: args[-2], RUN_DIR_VAR: str(run_dir),
                       AGENT_PID_VAR: str(os.getpid())})
    # In-memory checkpoints: this agent owns the slots, so they outlive its workers.
    slots = (HostSlots.create(opts.nproc_per_node, SLOTS_PER_RANK + BUDDY_SLOTS)
             if spec.checkpoint.memory_every else None)
    if slots is not None:
        os.environ[MEMORY_VAR] = slots.describe()
    try:
        return NodeRun(spec, opts, node, (entrypoint, args), zygote, on_health, lock_lost).run()
    finally:
        if slots is not None:
            slots.close()


class Witness:
    """What the agent learns from the run's log as it grows: the failures logged since it
    started (for ``policy.stop_reason``) and the job's highest completed step (for the
    restart budget). Reading the whole log at each failure cost ~0.3 s per 20,000 events, on
    the path of every restart, and grew with the run; so it reads only what was appended,
    and the agent's monitor loop calls ``poll`` every ``POLL_S`` to keep each read small."""

    POLL_S = 1.0

    def __init__(self, path: Path, node: str, since: float) -> None:
        self._tail = EventTail(path)  # from the end: this agent's attempts come later
        self._node, self._since = node, since
        self.failures: list[dict] = []
        self.high_step = 0
        self._last_poll = 0.0

    def poll(self, force: bool = True) -> None:
        now = time.monotonic()
        if not force and now - self._last_poll < self.POLL_S:
            return
        self._last_poll = now
        for e in self._tail.read():
            kind = e.get("event")
            if kind == "failure":
                self.failures.append(e)
            elif kind in ("step", "finish") and isinstance(e.get("step"), int):
                self.high_step = max(self.high_step, e["step"])

    def judge(self) -> str | None:
        self.poll()
        return stop_reason(self.failures, self._node, self._since)

    def progress(self) -> int:
        self.poll()
        return self.high_step


class NodeRun:
    """One node's run of the agent, from its ``start`` event to its ``exit`` event: what
    ``run_agent`` was given (the job, this node's options, its worker command, zygote and
    hooks) and what the run builds on the way (its event log, step watchdog and launch), so
    that each step is a method over those instead of a relay of parameters. ``run`` once."""

    def __init__(self, spec: JobSpec, opts: NodeOptions, node: str, command: tuple[str, list[str]], zygote: Any = None,
                 on_health: Callable | None = None, lock_lost: Callable[[bool], str] | None = None) -> None:
        self.spec, self.opts, self.node, self.command = spec, opts, node, command
        self.zygote, self.on_health, self.lock_lost = zygote, on_health, lock_lost
        self.events = EventLog(Path(opts.run_dir) / runfiles.EVENTS)
        self.timer_server: Any = None  # the step watchdog (``agent.watchdog``), once started
        self.launch: Any = None  # ``agent.elastic.Launch``, once built and hooked up

    def run(self) -> int:
        """Run the agent to its end: ``start``, the step watchdog and the isolation watch,
        the agent, then ``exit``; its exit code."""
        from elastic_harness.agent import watchdog

        opts = self.opts
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        self.events.emit("start", who="agent", node=self.node, run_id=opts.rdzv_id,
                         nproc_per_node=opts.nproc_per_node, nodes=f"{opts.min_nodes}:{opts.max_nodes}",
                         endpoint=opts.rdzv_endpoint)
        # Step watchdog: workers renew a file timer around each step (runtime.timer); a hung
        # or frozen worker is SIGKILLed when it lapses, and this agent restarts the group.
        self.timer_server = watchdog.start(opts.rdzv_id, Path(opts.run_dir))
        cutoff = isolation.watch(self.spec, opts, self.events, self.node)  # None when isolation_timeout is 0
        try:
            code, message = self.outcome()
        finally:
            if self.timer_server is not None:  # None: no step watchdog on this torch (``watchdog.start``)
                self.timer_server.stop()
            if cutoff is not None:
                cutoff.stop()
        self.events.emit("exit", who="agent", node=self.node, code=code, message=message)
        return code

    def outcome(self) -> tuple[int, str]:
        """Run the agent: its exit code and the line saying why (empty when it ended well)."""
        try:
            # Inside the try: the rendezvous handler is built here, and a backend that cannot
            # be reached at start-up raises then (a RendezvousConnectionError).
            self.launch = self.started()
            if self.lock_lost is not None:
                self.launch.agent.lock_lost = self.lock_lost
            self.launch.run()
        except Exception as e:  # noqa: BLE001 - ``ending`` says which end an agent's; the rest propagate
            facts = AgentFacts() if self.launch is None else AgentFacts.of(self.launch.agent)
            said = ending(e, facts, self.spec, self.opts)
            if said is None:
                raise
            return said
        return EXIT_OK, ""

    def started(self) -> Any:
        """The launch, its hang reports and health hooked up, ready to ``run``."""
        from elastic_harness.rendezvous.handler import group_running

        witness = Witness(Path(self.opts.run_dir) / runfiles.EVENTS, self.node, time.time())
        launch = self.built(witness)
        strikes = keep_out(launch.agent, self.spec, self.events, self.node)
        if self.timer_server is not None:  # None: no step watchdog on this torch (``watchdog.start``)
            self.timer_server.on_reap = hang_reporter(self.events, self.node, launch.agent.rank_of,
                                                      lambda: witness.high_step, self.spec.timeouts.step, strikes)
            watch_stalls(self.timer_server, launch, self.events, self.node, lambda: witness.high_step)
        if self.on_health is not None:
            self.on_health(launch.agent.health)
        if self.zygote is not None and group_running(launch.spec.rdzv_handler):
            # Join once workers can be forked at once: a node joining a running job makes the
            # group drain as soon as it waits in the rendezvous, and the whole group would
            # then wait for these imports (seconds: a join's pause). Not when no
            # group runs yet (the job's start): the first round then overlaps the imports,
            # and forking the workers waits for them (``Zygote.spawn``).
            self.zygote.wait_ready(ZYGOTE_READY_S)
        return launch

    def built(self, witness: Witness) -> Any:
        """This node's ``agent.elastic.Launch``: torchelastic's agent with our rendezvous
        handler, judged and budgeted by what ``witness`` reads in the run's log."""
        from elastic_harness.agent.elastic import AgentSettings, Launch

        spec, events, node, zygote = self.spec, self.events, self.node, self.zygote
        config = launch_config(spec, self.opts)
        config.event_log_handler = bridge.install(events, node)
        r, t = spec.rendezvous, spec.timeouts
        settings = AgentSettings(judge=witness.judge, progress=witness.progress, restart_window=spec.restart_window,
                                 tick=lambda: witness.poll(force=False),
                                 quiet_bound_s=r.join_timeout + r.last_call_timeout + t.shutdown_grace + 30,
                                 zygote=zygote, report=phase_reporter(events, node, warm=zygote is not None),
                                 on_failure=exit_reporter(events, node), in_place=spec.recovery == "in_place",
                                 park_bound_s=t.step or PARK_BOUND_S)
        return Launch(config, *self.command, settings,
                      exit_barrier_s=finish_bound_s(t.process_group, t.shutdown_grace), shutdown_grace=t.shutdown_grace)


@dataclasses.dataclass(frozen=True)
class AgentFacts:
    """What the agent knew when it ended (``agent.elastic.HarnessAgent``'s fields); the
    defaults when it was never built."""

    formed: bool = False  # a rendezvous completed and workers started
    lost_lock: str = ""  # why this submission no longer holds the run dir
    excluded: str | None = None  # why this node is kept out of the job
    stop_reason: str | None = None  # why it stopped restarting (fatal error, crash loop)
    exhausted: str | None = None  # why the restart budget ran out

    @classmethod
    def of(cls, agent: Any) -> AgentFacts:
        return cls(formed=agent.formed, lost_lock=agent.lost_lock, excluded=agent.excluded,
                   stop_reason=agent.stop_reason, exhausted=agent.budget.exhausted)


def ending(error: BaseException, facts: AgentFacts, spec: JobSpec, opts: NodeOptions) -> tuple[int, str] | None:
    """Pure: the agent's exit code and line for the exception that ended it (``facts``: what
    the agent knew then); None for an exception that is no agent's end (a bug: it propagates).
    A signal is 128 + its number; a worker failure (or a lost lock, or a group that left in
    place) is a lost lock's, an exclusion's, a stop reason's or the restart budget's; a
    rendezvous failure is ``rendezvous_exit_code``'s, explained by ``explain_rendezvous_error``."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    from elastic_harness.agent.elastic import GroupLeft

    if isinstance(error, SignalException):
        return 128 + int(error.sigval), f"agent received {error.sigval.name}"
    if isinstance(error, (ChildFailedError, LockLost, GroupLeft)):
        if facts.lost_lock:  # another job holds the run dir now: retrying cannot help
            return EXIT_PERMANENT, facts.lost_lock
        if facts.excluded:  # kept out (``rendezvous.exclusion``): the infrastructure's failure
            return EXIT_INFRA, facts.excluded
        if facts.stop_reason:
            return EXIT_PERMANENT, facts.stop_reason
        first = (_first_failure(error, opts.max_restarts, spec.restart_window)
                 if isinstance(error, ChildFailedError) else str(error))
        return EXIT_FAILED, facts.exhausted or first
    if isinstance(error, RendezvousError):
        detail = str(error.__cause__ or error)  # torch's own text says "see inner exception"
        at_start = not facts.formed
        kind = "EtcdWithoutV2" if at_start and etcd_without_v2(opts, detail) else type(error).__name__
        return rendezvous_exit_code(kind), explain_rendezvous_error(kind, detail, opts, spec.rendezvous.join_timeout,
                                                                    at_start=at_start)
    return None


def keep_out(agent, spec: JobSpec, events: EventLog, node: str):
    """This node's strikes (``rendezvous.exclusion``), given to ``agent``; its ``excluded`` event."""
    from elastic_harness.rendezvous.exclusion import Strikes

    strikes = Strikes(spec.nodes.exclude_after, spec.nodes.exclude_window)
    agent.strikes, agent._node_name = strikes, node
    agent.on_excluded = lambda message: events.emit("excluded", node=node, message=message,
                                                    failures=list(strikes.reasons),
                                                    window_s=spec.nodes.exclude_window)
    return strikes


def hang_reporter(events: EventLog, node: str, rank_of: Callable[[int], int | None],
                  last_step: Callable[[], int], timeout_s: float, strikes: Any = None) -> Callable[[int, float], None]:
    """The watchdog's report of a worker it killed (``agent.watchdog``): a ``hang`` failure
    naming the rank, the job's last completed step and how long the worker was silent; a
    strike against this node when the worker hung itself (``rendezvous.exclusion``). Called on
    the watchdog's thread."""
    from elastic_harness.rendezvous.exclusion import OWN_HANG_STATES

    def report(pid: int, silent_s: float, state: str = "") -> None:
        rank = rank_of(pid)
        step = last_step()
        if strikes is not None and state in OWN_HANG_STATES:
            strikes.add(f"rank {rank} hung{HANG_WORDS.get(state, '')}")
        who = f"rank {rank}" if rank is not None else f"worker pid {pid}"
        events.emit("failure", cause="hang", fatal=False, rank=rank, node=node, step=step,
                    seconds=round(silent_s, 3), state=state,
                    message=hang_message(who, step, silent_s, timeout_s, state))

    return report


def watch_stalls(timer_server, launch, events: EventLog, node: str, last_step: Callable[[], int]) -> None:
    """The step watchdog asks ``agent.stall`` about workers past their stall bound
    (``agent.watchdog``): a ``stall`` event when it starts looking, a ``node-lost`` failure
    for each worker it stopped on a verdict."""
    from elastic_harness.agent.stall import StallJudge

    rank_of = launch.agent.rank_of

    def stall(pid: int, stalled_s: float, bound_s: float) -> None:
        events.emit("stall", node=node, rank=rank_of(pid), step=last_step(), seconds=round(stalled_s, 3),
                    bound_s=round(bound_s, 3))

    timer_server.judge = StallJudge(launch.spec.rdzv_handler)
    timer_server.on_verdict = verdict_reporter(events, node, rank_of, last_step)
    timer_server.on_stall = stall
    keeper = launch.agent.keeper
    if keeper is not None:  # in place: a verdict makes the group leave its step, no worker is killed
        timer_server.leave = lambda pid, reason: keeper.leave_on_verdict(pid, reason) and (launch.agent.nudge() or True)


def verdict_reporter(events: EventLog, node: str, rank_of: Callable[[int], int | None],
                     last_step: Callable[[], int]) -> Callable[[int, float, Any], None]:
    """A ``node-lost`` failure for each worker the watchdog stopped on a verdict
    (``rendezvous.verdict``): which nodes are gone and why. Called on the watchdog's thread."""

    def report(pid: int, stalled_s: float, found: Any) -> None:
        rank = rank_of(pid)
        events.emit("failure", cause="node-lost", fatal=False, rank=rank, node=node, step=last_step(),
                    seconds=round(stalled_s, 3), gone=sorted(str(n) for n in found.gone),
                    message=(f"rank {rank if rank is not None else '?'} left its step: the group cannot go on "
                             f"({found.reason}); the group re-forms without the nodes gone"))

    return report


def hang_message(who: str, step: int, silent_s: float, timeout_s: float, state: str = "") -> str:
    """Pure: one line for a worker the step watchdog killed; ``state`` its /proc state
    before the kill, which tells the frozen rank from the peers waiting on it. Its timer
    expired, so it was silent for ``timeout_s`` at least (``silent_s`` is counted from when
    the watchdog last heard of it, which may be later than when the worker armed it)."""
    silent_s = max(silent_s, timeout_s)
    return (f"{who} hung{HANG_WORDS.get(state, '')}: no progress for {silent_s:.3g}s after step {step} "
            f"(timeouts.step={timeout_s:g}s); the watchdog killed it and the group restarts")


def exit_reporter(events: EventLog, node: str) -> Callable[[dict], None]:
    """The agent's account of a failed worker group (``agent.elastic.exit_account``): which
    rank exited how, the cause first. Called on the agent's main thread."""

    def report(a: dict) -> None:
        events.emit("failure", cause="exit", fatal=False, node=node, rank=a.get("rank"), step=a.get("step"),
                    worker_pid=a.get("worker_pid"), exit_code=a.get("exit_code"), signal=a.get("signal"),
                    recorded=a.get("recorded"), peer_lost=a.get("peer_lost"), message=a["message"])

    return report


def phase_reporter(events: EventLog, node: str, *, warm: bool):
    """The agent's account of its worker group (``agent.elastic.HarnessAgent``'s report)."""

    def report(state: str, restart: int, kept: list[int] | None = None, forked: list[int] | None = None) -> None:
        events.emit("workers", node=node, state=state, restart=restart, warm=warm, kept=kept, forked=forked)

    return report


def _first_failure(err, max_restarts: int, window: int) -> str:
    rank, failure = err.get_first_failure()
    msg = failure.message if isinstance(failure.message, str) else str(failure.message)
    return exhausted_message(max_restarts + 1, max_restarts, window,
                             f"rank {rank} exit {failure.exitcode}: {msg[:300]}")


# Rendezvous failures that fail again however often they are retried: a closed id (a new
# id fixes it); etcd settings that etcd refused (``rendezvous.etcd_v3``: fix the job); torch's
# etcd-v2 rendezvous against an etcd that serves no v2 API (``etcd_without_v2``).
PERMANENT_RENDEZVOUS_ERRORS = ("RendezvousClosedError", "EtcdMisconfigured", "EtcdWithoutV2")


def etcd_without_v2(opts: NodeOptions, detail: str) -> bool:
    """Pure: torch's etcd-v2 rendezvous found an etcd that answers, without the v2 API (its
    client's 404): a configuration error, not an outage."""
    word = _row(opts).refused_word
    return bool(word) and word in detail


def rendezvous_exit_code(kind: str) -> int:
    """Pure: a mistake (``PERMANENT_RENDEZVOUS_ERRORS``) exits 2; a spare that waited in
    torch's redundancy list until the job closed is done (torch's graceful exit: 0); every
    other rendezvous failure is the infrastructure's, worth a retry."""
    if kind == "RendezvousGracefulExitError":
        return EXIT_OK
    return EXIT_PERMANENT if kind in PERMANENT_RENDEZVOUS_ERRORS else EXIT_INFRA


def explain_rendezvous_error(kind: str, detail: str, opts: NodeOptions, join_timeout: int,
                             at_start: bool = False) -> str:
    """Pure: one line saying what a rendezvous failure means for this job (``at_start``:
    before this agent's first rendezvous completed)."""
    if kind == "EtcdMisconfigured":  # its message is the line, fix included
        return f"{detail}; nothing was trained" if at_start else detail
    if kind == "EtcdWithoutV2":
        return unreachable_backend(opts, detail)
    if kind == "RendezvousConnectionError" and at_start:
        return unreachable_backend(opts, detail)
    if kind == "RendezvousTimeoutError":
        return (f"too few nodes: fewer than nodes.min={opts.min_nodes} joined within "
                f"rendezvous.join_timeout={join_timeout}s; checkpoints are intact, start enough "
                "nodes and re-run to resume")
    if kind == "RendezvousConnectionError" and _row(opts).hosts_store and not opts.is_host:
        return (f"rendezvous host lost: the c10d store at {opts.rdzv_endpoint} lived in the agent "
                "that hosted it, and it is gone, which ends a c10d job (use rendezvous.backend: etcd "
                "to survive losing any node); re-run to resume with a new rendezvous id")
    if kind == "RendezvousClosedError":
        return f"rendezvous '{opts.rdzv_id}' is closed (that job already finished); use a new id"
    if kind == "RendezvousGracefulExitError":
        return "a spare: the job finished without needing this node"
    return f"rendezvous failed: {kind}: {detail[:300]}"


def unreachable_backend(opts: NodeOptions, detail: str) -> str:
    """Pure: the line for a rendezvous backend that cannot be used at start-up."""
    detail = " ".join(detail.split())[:200]
    if etcd_without_v2(opts, detail):  # an etcd that answers, without the v2 API: the job's settings
        v2 = "--enable-v2 (torch's etcd-v2 rendezvous speaks the v2 API: etcd 3.4 or 3.5; 3.6 has none)"
        return (f"the etcd at {opts.rdzv_endpoint} has no v2 API, which rendezvous.backend: etcd-v2 needs "
                f"({detail}); use rendezvous.backend: etcd (the v3 API), or restart etcd with {v2}; "
                "nothing was trained")
    return (f"cannot reach the {opts.rdzv_backend} rendezvous at {opts.rdzv_endpoint} ({detail}); "
            f"{_row(opts).unreachable_fix}; nothing was trained, re-run once it is up")


def _row(opts: NodeOptions) -> backends.Backend:
    """This agent's backend in the table (``spec/backends.py``); torch's own for any other
    backend name: its store outside the job, no fix known."""
    return backends.BY_TORCH_NAME.get(opts.rdzv_backend) or backends.Backend(
        opts.rdzv_backend, opts.rdzv_backend, opts.rdzv_backend, 0, hosts_store=False, settings=(),
        unreachable_fix="fix rendezvous.endpoint (--rdzv-endpoint)")
