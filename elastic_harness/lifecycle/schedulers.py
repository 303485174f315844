"""The schedulers, by name (``submit --scheduler``, and a record's ``scheduler``).

Adding one: a module in this package whose class implements ``api.Scheduler``, and its
line below. Modules are imported when first asked for.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from elastic_harness.lifecycle.api import Scheduler

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
