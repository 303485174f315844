"""What ``Run.register`` refuses, with the fix: state that could not be checkpointed, or a
job that would train on to the end, exit 0, and be wrong.

- ``check_registration``: the model is a module, the optimizer holds its parameters, a
  scheduler belongs to that optimizer, every extra object's state pickles (pure).
- ``distributed`` / ``replicas_differ``: with more than one data-parallel rank, a model
  that is neither replicated (DDP, ``replicate``) nor sharded (FSDP, FSDP2's
  ``fully_shard``, DTensor parameters) trains one copy per rank; they drift apart and the
  checkpoint mixes them (each rank writes its own tensors under the same names). Such a
  model is compared across ranks (a digest of its parameters) before the first save, and
  the job stops if the copies differ. Certain (a script that averages gradients itself,
  or trains with lr 0, passes) and cheap (once, and only for an unwrapped model).
- ``unregistered_schedulers``: LR schedulers built over the registered optimizer that were
  not registered. Their position is not saved, so after a restart the warm-up starts over
  and the model differs from an uninterrupted run. Cheap: torch wraps an optimizer's
  ``step`` when a scheduler is built over it; only then are the optimizer's referrers
  searched (``gc``, once). ``ReduceLROnPlateau`` does not wrap ``step``: not detected.
"""

from __future__ import annotations

import gc
import hashlib
import pickle
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from elastic_harness.errors import UsageError
from elastic_harness.torchcompat.nn import (
    replicate_applied,
    scheduler_built_over,
    scheduler_parts,
    unwrap_compiled,
)


def parameters_digest(model: nn.Module) -> str:
    """sha256 over this rank's parameters (names, shapes, bytes); no collective."""
    from elastic_harness.runtime.digest import tensor_bytes

    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(tensor_bytes(name, p))
    return h.hexdigest()


def replicas_differ(model: nn.Module, gather: Callable[[str], list[str]]) -> list[int]:
    """Every rank: the ranks whose parameters differ from rank 0's (``gather``: an
    all-gather over the job's ranks, so every rank decides alike)."""
    digests = gather(parameters_digest(model))
    return [rank for rank, d in enumerate(digests) if d != digests[0]]


def unwrapped_error(model: nn.Module, step: int, ranks: list[int]) -> UsageError:
    return UsageError(
        f"the ranks' models differ at step {step} (ranks {', '.join(map(str, ranks))} vs rank 0): the "
        f"registered model ({type(model).__name__}) is not wrapped for data parallelism, so each rank "
        "trains its own copy; no checkpoint of them was written",
        "wrap it before registering: DDP(model, device_ids=run.device_ids), or fully_shard(model)",
    )


def distributed(model: nn.Module) -> bool:
    """Is ``model`` (or the module ``torch.compile`` wraps) replicated or sharded?"""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    inner = unwrap_compiled(model)
    if isinstance(inner, (DistributedDataParallel, FullyShardedDataParallel, FSDPModule)):
        return True
    if replicate_applied(inner):  # composable DDP records itself in a private registry
        return True
    return any(isinstance(p, DTensor) for p in inner.parameters())


def unregistered_schedulers(optimizer: torch.optim.Optimizer, registered: list[Any]) -> list[Any]:
    """LR schedulers over ``optimizer`` that are neither in ``registered`` nor held by one
    that is (``SequentialLR``/``ChainedScheduler`` save their parts)."""
    if not scheduler_built_over(optimizer):
        return []  # no scheduler was ever built over it (module doc)
    from torch.optim.lr_scheduler import LRScheduler

    known = {id(s) for s in registered}
    for s in registered:
        known.update(id(part) for part in scheduler_parts(s))
    def search() -> list[Any]:
        return [r for r in gc.get_referrers(optimizer) if isinstance(r, LRScheduler)
                and getattr(r, "optimizer", None) is optimizer and id(r) not in known]

    # A scheduler the script dropped may wait for the cycle collector: ask it first.
    return search() and (gc.collect() or True) and search()


def check_schedulers(optimizer: torch.optim.Optimizer, registered: list[Any]) -> None:
    missing = unregistered_schedulers(optimizer, registered)
    if missing:
        names = ", ".join(type(s).__name__ for s in missing)
        raise UsageError(
            f"an LR scheduler ({names}) steps the registered optimizer but was not registered: "
            "its position would not be saved, and after a restart its schedule would start over",
            "pass it to run.register(model, optimizer, scheduler=scheduler), before run.steps()",
        )


def short_schedule(registered: list[Any], step: int, steps: int) -> tuple[str, int, int, int] | None:
    """Pure: ``(name, total_steps, projected count, the most train.steps it allows)`` of a
    restored scheduler that would raise before the job's ``steps`` updates are done, or None.

    ``OneCycleLR`` saves its ``total_steps`` with its position: a job resumed with a larger
    ``train.steps`` keeps the old total and raises ("Tried to step N times") once past it,
    on every restart. Its own count at ``step`` updates (``last_epoch``) says how often the
    script steps it per update, so a schedule stepped per epoch is not taken for a short one."""
    if step <= 0:
        return None
    parts = [p for s in registered for p in (s, *(getattr(s, "_schedulers", ()) if _chained(s) else ()))]
    for part in parts:
        total, count = getattr(part, "total_steps", None), getattr(part, "last_epoch", None)
        if not (isinstance(total, int) and isinstance(count, int) and count > 0):
            continue
        projected = -(-count * steps // step)  # its count after the job's last update (ceil)
        if projected > total:
            return type(part).__name__, total, projected, total * step // count
    return None


def _chained(s: Any) -> bool:
    """A ``ChainedScheduler`` steps its parts together (a ``SequentialLR`` restarts each)."""
    from torch.optim.lr_scheduler import ChainedScheduler

    return isinstance(s, ChainedScheduler)


def short_schedule_error(found: tuple[str, int, int, int], step: int, steps: int) -> UsageError:
    name, total, projected, most = found
    return UsageError(
        f"the LR scheduler ({name}) restored at step {step} was built for total_steps={total}, but "
        f"train.steps={steps} would step it {projected} times: {name} keeps the total it was saved with "
        f"and raises once past it",
        f"keep train.steps at most {most} for this run, or build the "
        "schedule from run.spec.train.steps as a LambdaLR (its length is not saved; docs/script-api.md), "
        "or start a new run (--fresh)",
    )


def check_registration(model: Any, optimizer: Any, scheduler: Any, extra: dict) -> None:
    """Refuse what cannot be checkpointed correctly, with the fix (pure checks)."""
    if not isinstance(model, nn.Module):
        raise UsageError(f"run.register(model=...) got {type(model).__name__}, not a torch.nn.Module",
                         "pass the (wrapped) model")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UsageError(f"run.register(optimizer=...) got {type(optimizer).__name__}, not a "
                         "torch.optim.Optimizer", "pass the optimizer that trains the model")
    own = {id(p) for p in model.parameters()}
    stray = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in own]
    if stray:
        raise UsageError(
            f"the optimizer holds {len(stray)} tensors that are not parameters of the registered "
            "model (built before the model was wrapped, moved or sharded?)",
            "build the optimizer after wrapping, over the wrapped model's parameters "
            "(e.g. optim.AdamW(ddp_model.parameters()))",
        )
    if scheduler is not None:
        _check_stateful("scheduler", scheduler)
        if getattr(scheduler, "optimizer", optimizer) is not optimizer:
            raise UsageError("the LR scheduler belongs to another optimizer than the registered one",
                             "build the scheduler over the registered optimizer")
    for name, obj in extra.items():
        if not isinstance(obj, dict):
            _check_stateful(name, obj)


def _check_stateful(name: str, obj: Any) -> None:
    if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
        raise UsageError(f"'{name}' ({type(obj).__name__}) has no state_dict()/load_state_dict()",
                         "register objects with both methods, or plain dicts of tensors and values")
    try:
        pickle.dumps(obj.state_dict())
    except Exception as e:  # noqa: BLE001 - any pickling failure means it cannot be saved
        raise UsageError(
            f"the state of '{name}' ({type(obj).__name__}) cannot be saved: {e}",
            "keep only plain values in its state_dict() (e.g. use a module-level function, not a "
            "lambda, for LambdaLR-style schedules held by an object)",
        ) from None


