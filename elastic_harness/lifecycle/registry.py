"""Where jobs are recorded, and where stop requests are left.

The registry is one JSON file per job, ``STATE_DIR/jobs/<id>.json`` (a ``JobRecord``),
written once when the job is submitted (``submit``) or started (``run``). ``STATE_DIR`` is
``$ELASTIC_HARNESS_STATE_DIR``, else ``$XDG_STATE_HOME/elastic-harness``, else
``~/.local/state/elastic-harness`` (``state_dir``). Tests point the variable at a temp dir.

A job's id is the rendezvous id of its submission (``launch.config.new_rdzv_id``: the job
name and 12 hex digits; or ``rendezvous.id`` when the user pinned one): it is also what holds
the run directory's lock, so "which job holds this run dir" and "which job is this" agree.

A stop request is a small JSON file (when, ``--now`` or not, who asked) next to what it
stops: ``RUN_DIR/lifecycle/<id>.stop`` for local and Slurm jobs, where the sbatch script
looks before requeueing (the run dir is shared with the cluster), and
``STATE_DIR/jobs/<id>.stop`` for Kubernetes jobs, which have no run dir here. A stop request
turns "preempted" into "stopped" in ``status``.

Records and requests are written atomically (rename). ``forget`` deletes a record (``list
--prune``), never a run directory or a checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from elastic_harness import runfiles
from elastic_harness.errors import HarnessError

STATE_VAR = "ELASTIC_HARNESS_STATE_DIR"
LIFECYCLE_DIR = runfiles.LIFECYCLE  # inside a run dir: stop requests, the Slurm script and job file


@dataclass(frozen=True)
class JobRecord:
    """What ``status``, ``logs`` and ``stop`` need to find a job again: what every job has,
    and ``details``, which its scheduler alone writes and reads (its module says what: the
    supervisor's pid, the Slurm job id, the Kubernetes objects). Stored as one flat JSON
    object, the details beside the rest, as records were before they had a field of their own."""

    id: str
    name: str
    scheduler: str  # a name in ``schedulers.SCHEDULERS``
    submitted: float  # unix seconds
    total_steps: int
    run_dir: str = ""  # local and Slurm jobs ("" for Kubernetes: the run dir is in the cluster)
    job_file: str = ""  # the job YAML as given
    via: str = "submit"  # "submit", or "run" for a job started in a terminal
    details: dict = field(default_factory=dict)  # the scheduler's own
    # its status once it ended (``state.JobStatus`` as a dict; ``schedulers.status_of``): what
    # ``status`` says when the evidence is gone (say, the run directory was removed)
    outcome: dict = field(default_factory=dict)

    def to_json(self) -> str:
        common = {k: v for k, v in dataclasses.asdict(self).items() if k != "details" and (k != "outcome" or v)}
        assert not common.keys() & self.details.keys(), f"a {self.scheduler} detail shadows a common field"
        return json.dumps({**common, **self.details}, indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping) -> JobRecord:
        common = {f.name for f in dataclasses.fields(cls)} - {"details"}
        return cls(**{k: v for k, v in data.items() if k in common},
                   details={k: v for k, v in data.items() if k not in common})


def state_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The registry's root (module doc)."""
    env = os.environ if environ is None else environ
    if env.get(STATE_VAR):
        return Path(env[STATE_VAR])
    base = Path(env["XDG_STATE_HOME"]) if env.get("XDG_STATE_HOME") else Path.home() / ".local" / "state"
    return base / "elastic-harness"


def _write_atomic(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        raise HarnessError(f"cannot write '{path}': {e.strerror or e}",
                           f"fix its permissions, or set {STATE_VAR} to a directory you can write") from None


def ensure_writable(root: Path) -> None:
    """Fail before a job starts if its record could not be written afterwards."""
    _write_atomic(root / "jobs" / f".probe-{os.getpid()}", "")
    (root / "jobs" / f".probe-{os.getpid()}").unlink()


def save(record: JobRecord, root: Path) -> Path:
    path = root / "jobs" / f"{record.id}.json"
    _write_atomic(path, record.to_json())
    return path


def load(job_id: str, root: Path) -> JobRecord | None:
    try:
        return JobRecord.from_dict(json.loads((root / "jobs" / f"{job_id}.json").read_text()))
    except (OSError, ValueError, TypeError):
        return None


def forget(job_id: str, root: Path) -> None:
    """Delete job ``job_id``'s record (and a stop request kept beside it): its run directory,
    logs and checkpoints stay where they are."""
    for path in (root / "jobs" / f"{job_id}.json", root / "jobs" / f"{job_id}.stop"):
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            raise HarnessError(f"cannot remove '{path}': {e.strerror or e}",
                               f"fix its permissions, or set {STATE_VAR} to a directory you can write") from None


def records(root: Path) -> list[JobRecord]:
    """Every readable record, oldest submission first (unreadable files are skipped)."""
    folder = root / "jobs"
    found = [load(p.stem, root) for p in folder.glob("*.json")] if folder.is_dir() else []
    return sorted((r for r in found if r is not None), key=lambda r: (r.submitted, r.id))


def find(ref: str, root: Path) -> JobRecord:
    """The job named ``ref``: an exact id, else the newest job of that name, else the one id
    it is a prefix of. ``HarnessError`` when none or several match."""
    everything = records(root)
    exact = [r for r in everything if r.id == ref]
    if exact:
        return exact[0]
    named = [r for r in everything if r.name == ref]
    if named:
        return named[-1]
    prefixed = [r for r in everything if r.id.startswith(ref)]
    if len(prefixed) == 1:
        return prefixed[0]
    if len(prefixed) > 1:
        raise HarnessError(f"'{ref}' matches {len(prefixed)} jobs: {', '.join(r.id for r in prefixed[:5])}",
                           "give more of the id (elastic-harness list shows them)")
    raise HarnessError(f"no job '{ref}' in {root / 'jobs'}",
                       "elastic-harness list shows the known jobs; a run directory path works too")


# ----- stop requests ---------------------------------------------------------------------------
def stop_path(record: JobRecord, root: Path) -> Path:
    """Where a stop request for ``record`` lives (module doc)."""
    if record.run_dir:
        return Path(record.run_dir) / LIFECYCLE_DIR / f"{record.id}.stop"
    return root / "jobs" / f"{record.id}.stop"


def request_stop(record: JobRecord, root: Path, now: bool,
                 clock: Callable[[], float] = time.time) -> Path:
    path = stop_path(record, root)
    _write_atomic(path, json.dumps({"t": clock(), "now": now, "by_pid": os.getpid()}))
    return path


def stop_request(record: JobRecord, root: Path) -> dict | None:
    """The stop request left for ``record`` (None if none)."""
    try:
        data = json.loads(stop_path(record, root).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
