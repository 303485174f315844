"""A run-dir job's status: read its events and stop request, then decide (``state``).

Local and Slurm jobs keep their events in their run directory (on this machine, or on
storage shared with the cluster); their schedulers differ only in the ``Liveness`` they
pass in.
"""

from __future__ import annotations

import time
from pathlib import Path

from elastic_harness.events import read_events
from elastic_harness.lifecycle import registry
from elastic_harness.lifecycle.registry import JobRecord
from elastic_harness.lifecycle.state import JobStatus, Liveness, status_from_events


def observe(record: JobRecord, live: Liveness, root: Path) -> JobStatus:
    """A run-dir job's status: its events, ``live`` and its stop request (``state``)."""
    base = JobStatus(id=record.id, name=record.name, scheduler=record.scheduler, state="pending",
                     where=live.detail, run_dir=record.run_dir, total_steps=record.total_steps,
                     submitted=record.submitted)
    events = read_events(Path(record.run_dir) / "events.jsonl")
    return status_from_events(base, events, live, registry.stop_request(record, root), time.time())
