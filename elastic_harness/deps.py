"""What this install has: the optional extras.

The core install is small; S3 checkpoints, TensorBoard files, ``report.png``, torch's
etcd-v2 rendezvous and ``bench throughput`` (Pillow) each need one extra
(``pip install 'elastic-harness[EXTRA]'``). ``require_extra`` checks that the module can be
found (without importing it): one user-facing line and exit 2. The installed torch is
checked by ``torchcompat.host`` (the release range and every private name the harness reaches).

Imports nothing of ours but ``errors`` (the spec-facing check takes the spec duck-typed).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from elastic_harness.errors import HarnessError
from elastic_harness.spec.backends import BY_NAME

# extra -> (the module it provides, what it is for); pyproject.toml's optional-dependencies
EXTRAS: dict[str, tuple[str, str]] = {
    "s3": ("s3fs", "checkpoint.dir on s3://"),
    "tensorboard": ("tensorboard", "metrics.tensorboard: true"),
    "report": ("matplotlib", "report.png"),
    "etcd": ("etcd", "rendezvous.backend: etcd-v2"),
    "bench": ("PIL", "bench throughput (its images are JPEG files)"),
}


class MissingExtra(HarnessError):
    """An optional feature is used without the extra that provides it."""


def has_module(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require_extra(extra: str) -> None:
    """One line naming the extra when its module is missing."""
    module, purpose = EXTRAS[extra]
    if not has_module(module):
        raise MissingExtra(f"{purpose} needs the '{extra}' extra ({module} is not installed): "
                           f"pip install 'elastic-harness[{extra}]'")


def extras_for(spec: Any) -> list[str]:
    """The extras a job spec uses (pure)."""
    need = []
    if str(spec.checkpoint.dir).startswith("s3://"):
        need.append("s3")
    if spec.metrics.tensorboard:
        need.append("tensorboard")
    extra = BY_NAME[spec.rendezvous.backend].extra  # etcd-v2: torch's v2 client; etcd (v3) needs none
    if extra:
        need.append(extra)
    return need


def require_spec_extras(spec: Any) -> None:
    """Before any agent starts: every extra this job uses is installed."""
    for extra in extras_for(spec):
        require_extra(extra)
