"""A run-dir job's status: read its events and stop request, then decide (``state``).

Local and Slurm jobs keep their events in their run directory (on this machine, or on
storage shared with the cluster); their schedulers differ only in the ``Liveness`` they
pass in.
"""

from __future__ import annotations

import time
from pathlib import Path

from elastic_harness import runfiles
from elastic_harness.events import read_events
from elastic_harness.lifecycle import registry
from elastic_harness.lifecycle.registry import JobRecord
from elastic_harness.lifecycle.state import JobStatus, Liveness, invocation_of, status_from_events


def observe(record: JobRecord, live: Liveness, root: Path) -> JobStatus:
    """A run-dir job's status: its events, ``live`` and its stop request (``state``)."""
    base = JobStatus(id=record.id, name=record.name, scheduler=record.scheduler, state="pending",
                     where=live.detail, run_dir=record.run_dir, total_steps=record.total_steps,
                     submitted=record.submitted)
    events = submission_events(Path(record.run_dir), record.id)
    return status_from_events(base, events, live, registry.stop_request(record, root), time.time())


def submission_events(run_dir: Path, job_id: str) -> list[dict]:
    """The events of the log holding submission ``job_id`` (``submission_log``)."""
    return read_events(submission_log(run_dir, job_id))


def submission_log(run_dir: Path, job_id: str) -> Path:
    """The run dir's event log, or, when ``--fresh`` has since moved the log holding this
    submission aside (``events.jsonl.old-STAMP``, ``rundir``), that one: each submission
    keeps its own record (a job that succeeded stays succeeded, its logs keep their ranks)."""
    current = run_dir / runfiles.EVENTS
    if invocation_of(read_events(current), job_id):
        return current
    for old in sorted(run_dir.glob(f"{runfiles.EVENTS}.old-*"), reverse=True):
        if invocation_of(read_events(old), job_id):
            return old
    return current
