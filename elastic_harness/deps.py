"""What this install has: the torch we were written against, and the optional extras.

One home for two install-time decisions, each a user-facing line and exit 2:

- **torch version.** We replace private functions of torch 2.13.0 (the dynamic rendezvous'
  ``get_method_name``, ``construct_and_record_rdzv_event`` and ``_delay``; DCP's
  ``FileSystemWriter._write_data`` and ``DefaultSavePlanner._cached_plans_key``). Their
  names and signatures are not promised between releases, so ``require_torch`` refuses any
  other version before patching, instead of failing somewhere inside torch.
- **extras.** The core install is small; S3 checkpoints, TensorBoard files, ``report.png``,
  the etcd-v2 rendezvous and ``bench throughput`` (Pillow) each need one extra
  (``pip install 'elastic-harness[EXTRA]'``).
  ``require_extra`` checks that the module can be found (without importing it).

Imports nothing of ours but ``errors`` (the spec-facing check takes the spec duck-typed).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from elastic_harness.errors import HarnessError

TORCH_VERSION = "2.13.0"  # keep equal to pyproject.toml's exact pin

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


class TorchVersionError(HarnessError):
    """The installed torch is not the release whose private functions we patch."""


def torch_release(version: str) -> str:
    """``2.13.0+cpu`` -> ``2.13.0`` (the local build tag says CPU or CUDA, not the API)."""
    return version.split("+", 1)[0]


def require_torch(what: str, version: str | None = None) -> None:
    """Refuse to patch ``what`` (torch private functions) on a torch other than 2.13.0."""
    if version is None:
        import torch

        version = torch.__version__
    if torch_release(version) != TORCH_VERSION:
        raise TorchVersionError(
            f"elastic-harness patches {what}, private to torch {TORCH_VERSION}, but torch "
            f"{version} is installed: pip install 'torch=={TORCH_VERSION}'")


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
    if spec.rendezvous.backend == "etcd-v2":  # torch's v2 client; etcd (v3) needs no library
        need.append("etcd")
    return need


def require_spec_extras(spec: Any) -> None:
    """Before any agent starts: every extra this job uses is installed."""
    for extra in extras_for(spec):
        require_extra(extra)
