"""Run one elastic agent (one node) in this process: torchelastic's agent (``launch.elastic``).

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

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastic_harness import exitcodes
from elastic_harness.events import EventLog, EventTail
from elastic_harness.launch import bridge, isolation
from elastic_harness.launch.config import NodeOptions, launch_config, worker_command
from elastic_harness.launch.env import AGENT_PID_VAR, JOB_VAR, MEMORY_VAR, NODE_VAR, RUN_DIR_VAR
from elastic_harness.launch.policy import stop_reason
from elastic_harness.memtier.host import HostSlots
from elastic_harness.spec import JobSpec

EXIT_OK, EXIT_FAILED, EXIT_PERMANENT = exitcodes.OK, exitcodes.FAILED, exitcodes.PERMANENT
EXIT_INFRA = exitcodes.INFRA


def run_agent(spec: JobSpec, opts: NodeOptions, node: str = "",
              on_health: Callable[[Callable[[], tuple[bool, str]]], None] | None = None,
              zygote: Any = None) -> int:
    """Run this node's agent to the end; its exit code. ``on_health`` receives the agent's
    health callable (for the endpoint's ``/healthz``) once the agent exists. ``zygote``: a
    started ``launch.zygote.Zygote`` for warm starts (``spec.warm_start``), or None; the
    caller starts it before anything imports torch, so that its imports overlap this
    process's (``commands.agent``), and stops it."""
    run_dir = Path(opts.run_dir)
    entrypoint, args = worker_command(run_dir)
    # Workers inherit the agent's environment: their node, job and run dir.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # see launch.config.agent_environ
    os.environ.update({NODE_VAR: node, JOB_VAR: args[-2], RUN_DIR_VAR: str(run_dir),
                       AGENT_PID_VAR: str(os.getpid())})
    # In-memory checkpoints: this agent owns the slots, so they outlive its workers.
    slots = HostSlots.create(opts.nproc_per_node) if spec.checkpoint.memory_every else None
    if slots is not None:
        os.environ[MEMORY_VAR] = slots.describe()
    try:
        return _run(spec, opts, node, (entrypoint, args), zygote, on_health)
    finally:
        if slots is not None:
            slots.close()


def _judge(path: Path, node: str, since: float) -> Callable[[], str | None]:
    """``policy.stop_reason`` over the failures logged since this agent started, read as the
    log grows. (Reading the whole log at each failure cost ~0.3 s per 20,000 events, on the
    path of every restart, and grew with the run.)"""
    tail = EventTail(path)  # from the end: the failures of this agent's attempts come later
    failures: list[dict] = []

    def judge() -> str | None:
        failures.extend(e for e in tail.read(containing=b'"failure"') if e.get("event") == "failure")
        return stop_reason(failures, node, since)

    return judge


def _run(spec: JobSpec, opts: NodeOptions, node: str, command: tuple, zygote,
         on_health: Callable | None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    from elastic_harness.launch import watchdog
    from elastic_harness.launch.elastic import Launch

    run_dir = Path(opts.run_dir)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    events = EventLog(run_dir / "events.jsonl")
    config = launch_config(spec, opts)
    config.event_log_handler = bridge.install(events, node)
    # Step watchdog: workers renew a file timer around each step (runtime.timer); a hung
    # or frozen worker is SIGKILLed when it lapses, and this agent restarts the group.
    timer_server = watchdog.start(opts.rdzv_id, Path(opts.run_dir))
    cutoff = isolation.watch(spec, opts, events, node)  # None when isolation_timeout is 0
    started = time.time()
    r, t = spec.rendezvous, spec.timeouts
    launch = Launch(config, *command,
                    judge=_judge(run_dir / "events.jsonl", node, started),
                    quiet_bound_s=r.join_timeout + r.last_call_timeout + t.shutdown_grace + 30,
                    zygote=zygote, report=phase_reporter(events, node, warm=zygote is not None))
    if on_health is not None:
        on_health(launch.agent.health)
    events.emit("start", who="agent", node=node, run_id=opts.rdzv_id, nproc_per_node=opts.nproc_per_node,
                nodes=f"{opts.min_nodes}:{opts.max_nodes}", endpoint=opts.rdzv_endpoint)
    code, message = EXIT_OK, ""
    try:
        launch.run()
    except SignalException as e:
        code, message = 128 + int(e.sigval), f"agent received {e.sigval.name}"
    except ChildFailedError as e:
        reason = launch.agent.stop_reason
        code, message = (EXIT_PERMANENT, reason) if reason else (EXIT_FAILED, _first_failure(e))
    except RendezvousError as e:
        code = rendezvous_exit_code(type(e).__name__)
        message = explain_rendezvous_error(type(e).__name__, str(e), opts, spec.rendezvous.join_timeout)
    finally:
        timer_server.stop()
        if cutoff is not None:
            cutoff.stop()
    events.emit("exit", who="agent", node=node, code=code, message=message)
    return code


def phase_reporter(events: EventLog, node: str, *, warm: bool):
    """The agent's account of its worker group (``launch.elastic.HarnessAgent``'s report)."""

    def report(state: str, restart: int) -> None:
        events.emit("workers", node=node, state=state, restart=restart, warm=warm)

    return report


def _first_failure(err) -> str:
    rank, failure = err.get_first_failure()
    msg = failure.message if isinstance(failure.message, str) else str(failure.message)
    return f"workers failed after all restarts (first: rank {rank}, exit {failure.exitcode}): {msg[:300]}"


def rendezvous_exit_code(kind: str) -> int:
    """Pure: a closed rendezvous id fails again however often it is retried (a new id
    fixes it); every other rendezvous failure is the infrastructure's, worth a retry."""
    return EXIT_PERMANENT if kind == "RendezvousClosedError" else EXIT_INFRA


def explain_rendezvous_error(kind: str, detail: str, opts: NodeOptions, join_timeout: int) -> str:
    """Pure: one line saying what a rendezvous failure means for this job."""
    if kind == "RendezvousTimeoutError":
        return (f"too few nodes: fewer than nodes.min={opts.min_nodes} joined within "
                f"rendezvous.join_timeout={join_timeout}s; checkpoints are intact, start enough "
                "nodes and re-run to resume")
    if kind == "RendezvousConnectionError" and opts.rdzv_backend == "c10d" and not opts.is_host:
        return (f"rendezvous host lost: the c10d store at {opts.rdzv_endpoint} lived in the agent "
                "that hosted it, and it is gone, which ends a c10d job (use rendezvous.backend: etcd "
                "to survive losing any node); re-run to resume with a new rendezvous id")
    if kind == "RendezvousClosedError":
        return f"rendezvous '{opts.rdzv_id}' is closed (that job already finished); use a new id"
    return f"rendezvous failed: {kind}: {detail[:300]}"
