"""Pick a scheduler by name (``submit --scheduler``, and a record's ``scheduler``)."""

from __future__ import annotations

from pathlib import Path

from elastic_harness.lifecycle.api import Scheduler
from elastic_harness.lifecycle.kube import KubeScheduler
from elastic_harness.lifecycle.local import LocalScheduler
from elastic_harness.lifecycle.slurm import SlurmScheduler


def scheduler_for(name: str, root: Path) -> Scheduler:
    """The scheduler called ``name``; ``root`` is the registry's state dir."""
    kinds = {"local": LocalScheduler, "slurm": SlurmScheduler, "k8s": KubeScheduler}
    if name not in kinds:
        raise AssertionError(f"unknown scheduler {name!r}")  # argparse and records restrict the names
    return kinds[name](root)
