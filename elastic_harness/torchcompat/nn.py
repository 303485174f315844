"""The worker side: private names of torch's modules, meshes, optimizers and tensors.

Each has a fallback that keeps the run correct, only slower or less checked:

- ``mesh-dp`` (``DeviceMesh._flatten``; torch has no public name for flattening mesh
  dimensions): off, a mesh layout has no ``mesh["dp"]`` (use ``mesh["dp_replicate", "dp_shard"]``);
- ``replicate-check`` (``torch.distributed._composable.contract._get_registry``): off, a
  model wrapped with ``replicate()`` counts as bare in the "is it wrapped?" check;
- ``cuda-fork-check`` (``torch.cuda._is_in_bad_fork``): off, CUDA's generator is seeded
  lazily in every worker (as torch does until CUDA is first used);
- ``foreach-copy`` (``torch._foreach_copy_``): off, a memory snapshot copies tensor by tensor;
- ``buffer-persistence`` (``nn.Module._non_persistent_buffers_set``): off, non-persistent
  buffers are broadcast with the persistent ones (one more broadcast per step);
- ``compiled-unwrap`` (``torch.compile``'s ``_orig_mod``): off, a compiled model is looked
  at as its wrapper (grad-sync toggles and the peer-copy check see no DDP inside);
- ``tensor-versions`` (``Tensor._version``, autograd's in-place counter): off, a failing rank
  does not keep its last step in memory (``checkpoint.memory_on_failure`` does nothing);
- ``lr-scheduler-check`` (``optimizer.step._wrapped_by_lr_sched``, ``SequentialLR``'s
  ``_schedulers``): off, an unregistered LR scheduler is not detected.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from elastic_harness.torchcompat.probe import attrs, feature, module, on


def _source_has(relative: str, *names: str) -> list[str]:
    """Names missing from one of torch's source files (read, not imported)."""
    spec = importlib.util.find_spec("torch")
    path = Path(spec.origin).parent / relative if spec and spec.origin else None
    try:
        text = path.read_text() if path is not None else ""
    except OSError:
        text = ""
    return [f"{relative}:{n}" for n in names if n not in text]


@feature("mesh-dp", "mesh['dp']", "a mesh layout has no mesh['dp']: use mesh['dp_replicate', 'dp_shard']")
def _mesh() -> list[str]:
    from torch.distributed.device_mesh import DeviceMesh

    return attrs(DeviceMesh, "_flatten")


@feature("replicate-check", "replicate() detection",
         "a model wrapped with torch's replicate() counts as not wrapped when ranks' models are compared")
def _replicate() -> list[str]:
    contract = module("torch.distributed._composable.contract")
    return ["_composable.contract._get_registry"] if contract is None else attrs(
        contract, "_get_registry", label="_composable.contract")


@feature("cuda-fork-check", "CUDA fork check", "CUDA's generator is seeded lazily in every worker")
def _cuda_fork() -> list[str]:
    return attrs(torch.cuda, "_is_in_bad_fork", label="torch.cuda")


@feature("foreach-copy", "one-call snapshot copy", "a memory snapshot copies tensor by tensor (slower)")
def _foreach() -> list[str]:
    return attrs(torch, "_foreach_copy_")


@feature("buffer-persistence", "non-persistent buffer check",
         "non-persistent buffers are broadcast with the persistent ones")
def _buffers() -> list[str]:
    return [] if hasattr(nn.Module(), "_non_persistent_buffers_set") else ["nn.Module._non_persistent_buffers_set"]


@feature("tensor-versions", "in-place change counters",
         "a failing rank does not keep its last step in memory (checkpoint.memory_on_failure is off)")
def _versions() -> list[str]:
    return [] if hasattr(torch.zeros(1), "_version") else ["Tensor._version"]


@feature("compiled-unwrap", "torch.compile unwrap",
         "a compiled model is looked at as its wrapper (its DDP or FSDP inside is not seen)")
def _compiled() -> list[str]:
    return _source_has("_dynamo/eval_frame.py", "_orig_mod")


@feature("lr-scheduler-check", "unregistered LR scheduler check", "an LR scheduler that was not registered is not detected")
def _schedulers() -> list[str]:
    return _source_has("optim/lr_scheduler.py", "_wrapped_by_lr_sched", "self._schedulers")


def flatten_mesh(mesh: Any, name: str) -> Any | None:
    """``mesh`` (a sub-mesh of several dimensions) flattened into one dimension ``name``,
    registered on its root mesh; None where ``mesh-dp`` is off."""
    return mesh._flatten(name) if on("mesh-dp") else None


def replicate_applied(model: nn.Module) -> bool:
    """Did torch's composable ``replicate()`` wrap ``model``?"""
    if not on("replicate-check"):
        return False
    from torch.distributed._composable.contract import _get_registry

    return "replicate" in (_get_registry(model) or {})


def cuda_in_bad_fork() -> bool:
    return bool(torch.cuda._is_in_bad_fork()) if on("cuda-fork-check") else False


def copy_all(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """``targets[i].copy_(sources[i])`` for every i, in one call where torch allows."""
    if on("foreach-copy"):
        torch._foreach_copy_(list(targets), list(sources))
        return
    for target, source in zip(targets, sources, strict=True):
        target.copy_(source)


def non_persistent_buffers(module_: nn.Module) -> set[str]:
    """Names of ``module_``'s own buffers that are not in its state dict."""
    return set(getattr(module_, "_non_persistent_buffers_set", ())) if on("buffer-persistence") else set()


def versions(tensors: Sequence[torch.Tensor]) -> tuple[int, ...] | None:
    """Each tensor's in-place change counter (autograd's; a change through ``.data`` is not
    counted), or None where ``tensor-versions`` is off."""
    return tuple(t._version for t in tensors) if on("tensor-versions") else None


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped, or ``model`` itself."""
    return getattr(model, "_orig_mod", model) if on("compiled-unwrap") else model


def scheduler_built_over(optimizer: Any) -> bool:
    """Was an LR scheduler ever built over ``optimizer``? (False where ``lr-scheduler-check``
    is off: then nothing is checked.)"""
    if not on("lr-scheduler-check"):
        return False
    return bool(getattr(optimizer.step, "_wrapped_by_lr_sched", False))


def scheduler_parts(scheduler: Any) -> tuple:
    """The schedulers a ``SequentialLR``/``ChainedScheduler`` holds (its saved parts)."""
    return tuple(getattr(scheduler, "_schedulers", ()) or ())
