"""The names torch's ``get_model_state_dict`` / ``get_optimizer_state_dict`` give the state,
kept, so that a durable save does not pay for them again on the training thread.

A checkpoint holds the model's and optimizer's state under world-size-free names
(``runtime.state``): torch's functions rename the module's own state dict (``module.`` and
``_orig_mod.`` prefixes dropped) and the optimizer's (parameter numbers become the parameters'
names). Each call re-derives those names by walking the model and its parameters: for the
churn bench's MLP on the 2-core machine at load 10-12, 1.1 + 0.9 ms a save (medians; p90 up
to 5 ms), before the copy, on the training thread; renaming the own state dicts took 0.2 +
0.16 ms.
The names depend only on the model's structure and the optimizer's parameter order, so they
are worked out once, from torch's own answer, and applied to the module's and optimizer's
own state dicts (which hold the same tensors) while that structure stays the same.

Torch stays the judge: a mapping is kept only if applying it to the own state dict gives
exactly torch's answer (the same names in the same order, the same tensors: one object, or
views of one storage with one layout; equal plain values); where it does not (a wrapper torch
renames otherwise, a torch release that changes what these functions return), nothing is kept
and torch's functions are called every time, as before.

Call order: ``model_names(own, torch's)`` / ``optim_names(own, torch's)`` once per structure
(None: keep calling torch), then ``named_model(own, names)`` / ``named_optim(own, names)`` for
each save while the structure's key (``model_key`` / ``optim_key``) is unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

WRAPPERS = ("module", "_orig_mod")  # path segments torch drops: DDP's and torch.compile's
STATE, GROUPS, PARAMS = "state", "param_groups", "params"


def same_data(a: Any, b: Any) -> bool:
    """Pure: do ``a`` and ``b`` hold the same data? One tensor, or views of one storage with one
    layout (DTensors: the same placements and mesh too); plain values: equal."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if type(a) is not type(b):
            return False
        if isinstance(a, DTensor):
            return (a.placements == b.placements and a.device_mesh == b.device_mesh
                    and same_data(a.to_local(), b.to_local()))
        return (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                and a.storage_offset() == b.storage_offset() and a.shape == b.shape
                and a.stride() == b.stride() and a.dtype == b.dtype and a.requires_grad == b.requires_grad)
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(same_data(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_data(x, y) for x, y in zip(a, b, strict=True))
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - a value without a plain truth: only itself is the same
        return a is b


def stripped(key: str) -> str:
    """``key`` without the wrappers' path segments."""
    return ".".join(p for p in key.split(".") if p not in WRAPPERS)


def model_key(own: dict[str, Any]) -> tuple[str, ...]:
    """What the model's names depend on: the own state dict's keys, in order."""
    return tuple(own)


def model_names(own: dict[str, Any], full: dict[str, Any]) -> list[tuple[str, str]] | None:
    """(torch's name, own key) in torch's order, if renaming ``own`` so gives ``full`` exactly;
    else None."""
    by_name = {stripped(k): k for k in own}
    if len(by_name) != len(own) or set(by_name) != set(full):
        return None
    names = [(name, by_name[name]) for name in full]
    return names if same_data(named_model(own, names), full) else None


def named_model(own: dict[str, Any], names: list[tuple[str, str]]) -> dict[str, Any]:
    return {name: own[key] for name, key in names}


def optim_key(model: nn.Module, optim: torch.optim.Optimizer) -> tuple:
    """What the optimizer's names depend on: its parameters in order, and the model's names."""
    return (tuple(id(p) for g in optim.param_groups for p in g[PARAMS]),
            tuple(name for name, _ in model.named_parameters()))


def optim_names(own: dict[str, Any], full: dict[str, Any]) -> dict[int, str] | None:
    """Parameter number -> torch's name, if renaming ``own`` (``optimizer.state_dict()``) so
    gives ``full`` exactly; else None."""
    numbers = [p for g in own.get(GROUPS, ()) for p in g[PARAMS]]
    names = [n for g in full.get(GROUPS, ()) for n in g[PARAMS]]
    if set(own) != {STATE, GROUPS} or len(numbers) != len(names) or len(set(numbers)) != len(numbers):
        return None
    fqns = dict(zip(numbers, names, strict=True))
    if not set(own[STATE]) <= set(fqns):
        return None
    return fqns if same_data(named_optim(own, fqns), full) else None


def named_optim(own: dict[str, Any], fqns: dict[int, str]) -> dict[str, Any]:
    return {STATE: {fqns[p]: v for p, v in own[STATE].items()},
            GROUPS: [{**g, PARAMS: [fqns[p] for p in g[PARAMS]]} for g in own[GROUPS]]}
