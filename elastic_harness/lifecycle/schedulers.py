"""The schedulers, by name (``submit --scheduler``, and a record's ``scheduler``).

Adding one: a module in this package whose class implements ``api.Scheduler``, and its
line below. Modules are imported when first asked for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from pathlib import Path

from elastic_harness.errors import HarnessError
from elastic_harness.lifecycle import registry
from elastic_harness.lifecycle.api import Scheduler
from elastic_harness.lifecycle.registry import JobRecord
from elastic_harness.lifecycle.state import JobStatus, settled, worth_recording

SCHEDULERS: dict[str, str] = {  # name -> "module:class"
    "local": "elastic_harness.lifecycle.local:LocalScheduler",
    "slurm": "elastic_harness.lifecycle.slurm:SlurmScheduler",
    "k8s": "elastic_harness.lifecycle.kube:KubeScheduler",
}


def scheduler_class(name: str) -> type:
    if name not in SCHEDULERS:
        raise AssertionError(f"unknown scheduler {name!r}")  # argparse and records restrict the names
    module, _, cls = SCHEDULERS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def scheduler_for(name: str, root: Path) -> Scheduler:
    """The scheduler called ``name``; ``root`` is the registry's state dir."""
    return scheduler_class(name)(root)


def status_of(record: JobRecord, root: Path) -> JobStatus:
    """A job's status (its scheduler's), kept: once the job ended its status is written into
    its record (``JobRecord.outcome``), and a record whose evidence is gone since (its run
    directory removed) answers with that outcome, saying so (``state.settled``)."""
    now = scheduler_for(record.scheduler, root).status(record)
    if worth_recording(now, record.outcome) and registry.load(record.id, root) is not None:
        with contextlib.suppress(HarnessError):  # a read-only registry: the status is still right now
            registry.save(dataclasses.replace(record, outcome=now.to_dict()), root)
    return settled(now, record.outcome)
