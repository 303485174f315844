"""Pure: what state a job is in, from its events and what its scheduler says.

Two witnesses, each trusted for what it knows:

- the run directory's event log, folded one way (``runstate``): how far training got, the
  host's ``exit`` event (code and message) when the supervisor recorded one, ``finish``;
- the scheduler (``Liveness``): are the job's processes queued, running, or gone (and with
  which exit code, when the scheduler keeps one). Local: the supervisor's pid. Slurm:
  squeue / scontrol / sacct. Kubernetes: the PyTorchJob or StatefulSet and its pods.

A stop request (``registry.stop_request``) turns a signal exit into ``stopped`` instead of
``preempted``. Processes that are gone without an exit record, and without a stop request,
are ``failed`` with the reason saying so: status never reports a dead job as running.

States: pending, running, succeeded, failed, stopped, preempted (``STATES``).
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Sequence
from dataclasses import dataclass

from elastic_harness import exitcodes
from elastic_harness.records.runstate import fold, split_invocations

STATES = ("pending", "running", "succeeded", "failed", "stopped", "preempted")
ACTIVE = ("pending", "running")
PHASES = ("queued", "running", "gone", "unknown")

_HINTS = {
    "infrastructure": "the infrastructure failed; submit again to resume",
    "permanent": "a mistake to fix first; then submit again to resume",
    "failed": "see `elastic-harness logs`; submitting again resumes",
}


@dataclass(frozen=True)
class Liveness:
    """What the scheduler says about a job's processes."""

    phase: str  # one of PHASES
    exit_code: int | None = None  # when gone, if the scheduler knows it
    detail: str = ""  # one phrase, e.g. "Slurm: PENDING (Priority)"


@dataclass
class JobStatus:
    id: str
    name: str
    scheduler: str
    state: str
    reason: str = ""
    where: str = ""  # "pid 12 on host", "Slurm job 7", "Kubernetes ns/name"
    run_dir: str = ""
    step: int | None = None
    total_steps: int = 0
    loss: float | None = None
    world_size: int | None = None
    nodes: int | None = None
    restarts: int | None = None
    recoveries: int | None = None
    last_checkpoint_step: int | None = None
    last_checkpoint: str | None = None
    wall_s: float | None = None
    exit_code: int | None = None
    submitted: float = 0.0
    model_digest: str | None = None  # of the final parameters, once finished

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def invocation_of(events: Sequence[dict], job_id: str) -> list[dict]:
    """The events of submission ``job_id``: the invocation whose host ``start`` carries it as
    ``run_id``. A run dir accumulates submissions; another job's events are not this one's."""
    for part in reversed(split_invocations(events)):
        first = part[0] if part else {}
        if first.get("event") == "start" and first.get("who") == "host" and first.get("run_id") == job_id:
            return part
    return []


def host_exit(events: Sequence[dict]) -> tuple[int, str] | None:
    exits = [e for e in events if e.get("event") == "exit" and e.get("who") == "host"]
    return (int(exits[-1]["code"]), str(exits[-1].get("message") or "")) if exits else None


def drained_at(events: Sequence[dict]) -> int | None:
    """The step the last attempt drained and saved at (None if it did not, or resumed after)."""
    last = [e for e in events if e.get("event") in ("drain", "resume")][-1:]
    return int(last[0]["step"]) if last and last[0]["event"] == "drain" else None


def trained(events: Sequence[dict]) -> bool:
    """A worker group formed (so the job is past waiting for nodes)."""
    return any(e.get("event") in ("rendezvous", "worker", "step") for e in events)


def decide(*, finished: bool, exit: tuple[int, str] | None, stop: dict | None, live: Liveness,
           started: bool, drained: int | None = None) -> tuple[str, str]:
    """Pure: (state, reason). ``exit``: the host's recorded exit; ``started``: a worker
    group formed; ``drained``: the step the last attempt drained and saved at, if it did.
    See the module doc for who is trusted for what. A job whose last step finished but whose
    host recorded a failing exit (``run --verify`` found another model, ranks cut short after
    the last step) failed: the exit is the host's verdict."""
    if finished and (exit is None or exit[0] == exitcodes.OK):
        return "succeeded", ""
    if exit is None and live.phase == "gone" and live.exit_code is not None:
        exit = (live.exit_code, live.detail)
    if exit is not None:
        return _from_exit(exit[0], exit[1], stop, drained)
    if live.phase == "queued":
        return "pending", live.detail or "queued"
    if live.phase == "gone":
        if stop is not None:
            return "stopped", "killed on request (stop --now)" if stop.get("now") else "stopped on request"
        return "failed", (live.detail or "its processes are gone") + ", without recording an exit"
    state = "running" if started else "pending"
    reason = "stop requested" if stop is not None else ("" if started else "waiting for nodes to join")
    return state, "; ".join(r for r in (reason, live.detail if live.phase == "unknown" else "") if r)


def _from_exit(code: int, message: str, stop: dict | None, drained: int | None) -> tuple[str, str]:
    kind = exitcodes.kind(code)
    if kind == "ok":
        return "succeeded", message
    if kind == "preempted":
        saved = f"drained and saved at step {drained}" if drained is not None else (message or f"exit {code}")
        if stop is not None:
            return "stopped", f"on request; {saved}"
        if code == 128 + signal.SIGINT:  # Ctrl-C of `run`: the user's own stop
            return "stopped", f"interrupted (SIGINT); {saved}"
        return "preempted", f"{saved}; submit again to resume"
    return "failed", f"{message or f'exit {code}'} (exit {code}: {_HINTS[kind]})"


def status_from_events(base: JobStatus, events: Sequence[dict], live: Liveness, stop: dict | None,
                       now: float) -> JobStatus:
    """Pure: fill ``base`` (identity fields) from this submission's events and ``live``."""
    mine = invocation_of(events, base.id)
    s = fold(mine)
    exit = host_exit(mine)
    state, reason = decide(finished=s.finished, exit=exit, stop=stop, live=live, started=trained(mine),
                           drained=drained_at(mine))
    active = state in ACTIVE
    wall = None if s.first_t is None else round((now if active else (s.last_t or now)) - s.first_t, 1)
    return dataclasses.replace(
        base, state=state, reason=reason, step=s.step if mine else None, loss=s.loss,
        world_size=s.world_size or None, nodes=s.nodes or None, restarts=s.restarts if mine else None,
        recoveries=s.recoveries if mine else None, last_checkpoint_step=s.last_checkpoint_step,
        last_checkpoint=s.last_checkpoint, wall_s=wall, model_digest=s.digest,
        exit_code=exit[0] if exit else (live.exit_code if live.phase == "gone" else None))


def settled(now: JobStatus, recorded: dict) -> JobStatus:
    """Pure: the status to show, given ``recorded``, the one kept in the job's record when it
    last was seen ended (``JobRecord.outcome``; {} if none): ``now``, unless ``now`` has no
    evidence of the job left (no event of it: its run directory was removed or reused) and
    an outcome was recorded; then that outcome, saying so."""
    if not recorded or now.step is not None or now.state in ACTIVE:
        return now
    fields = {f.name for f in dataclasses.fields(JobStatus)}
    kept = JobStatus(**{k: v for k, v in recorded.items() if k in fields})
    where = f"{now.run_dir} no longer holds its events" if now.run_dir else "its objects are gone"
    note = f"as recorded when it ended; {where}"
    return dataclasses.replace(kept, reason=f"{kept.reason}; {note}" if kept.reason else note)


def worth_recording(now: JobStatus, recorded: dict) -> bool:
    """Pure: keep ``now`` as the job's outcome? When it ended, with evidence (a step seen),
    and differs from what is recorded (a requeued Slurm job can end more than once)."""
    return now.state not in ACTIVE and now.step is not None and now.to_dict() != recorded
