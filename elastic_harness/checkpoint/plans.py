"""Save plans cached per checkpoint saver, so a periodic save does not plan from scratch.

Every DCP save plans what each rank writes: local plans, gathered on the coordinator,
deduplicated into a global plan, scattered back. Here, as with torch's own
``enable_plan_caching``, a rank whose local plan equals the previous save's sends an empty
plan (``SavePlan([], usable=False)``) and reuses its cached final plan, and the coordinator
reuses the cached global plan and metadata; a changed plan is planned again. The cache is
ours (``PlanCache``, one per saver's key) and the planner a ``DefaultSavePlanner`` subclass
overriding DCP's public planner methods: torch keeps its own cache in class-level dicts
keyed by a private attribute, which a release may rename. Our plans compare equal
when their items write the same index with the same tensor metadata (chunk, size, dtype and
the other properties): a little stricter than torch's comparison, which ignores the dtype.

The cached plans also say, before a save, which of this rank's plain tensors another rank
will write (DDP replicas: DCP has each written once): ``written_elsewhere`` returns them
when this state plans exactly as the cached local plan. If every rank says so, the cached
plans are what DCP will use, so the stager may leave those tensors out (a placeholder with
their shape instead of a copy): half the staging copy for two DDP ranks. The planner
refuses to write a placeholder, should a plan ever change unseen.

That answer is kept with the ``signature`` of the state it was given (everything DCP's local
plan depends on: the containers' types, keys and lengths, each tensor's type, shape and
properties, a DTensor's layout; not its values), and given again while the signature and
the cached plans stay the same: planning the state again took 1-2 ms of a save's time on
the training thread on the loaded 2-core machine; the signature a tenth of that.

Call order: ``written_elsewhere(key, state)`` before staging (then agree across ranks);
``planner(key)`` for every save of one saver (a new planner each time: it holds that
save's state dict); ``forget(key)`` once, when the saver closes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from elastic_harness.errors import CheckpointError

UNCHANGED = SavePlan([], usable=False)  # "same as the cached plan", as torch's caching sends it


@dataclass
class PlanCache:
    """One saver's plans from its last save: this rank's local and final plans; on the
    coordinator, every rank's local plan, the global plan and the metadata."""

    local: SavePlan | None = None
    final: SavePlan | None = None
    all_local: list[SavePlan] | None = None
    global_plan: list[SavePlan] | None = None
    metadata: Any = None
    pending: SavePlan | None = None  # this save's local plan, kept once the save planned whole
    # ``written_elsewhere``'s last answer: (signature, local, final, answer), valid while the
    # signature is the same and ``local`` and ``final`` are still the cached plans
    answer: tuple | None = None


_CACHES: dict[str, PlanCache] = {}


def same_plan(a: SavePlan, b: SavePlan) -> bool:
    """Pure: do two save plans write the same items (index, type, tensor metadata)?"""
    def items(p: SavePlan) -> list[tuple]:
        return [(i.type, i.index.fqn, i.index.offset, i.index.index, i.tensor_data) for i in p.items]
    return a.usable == b.usable and items(a) == items(b)


class _Planner(DefaultSavePlanner):
    def __init__(self, cache: PlanCache) -> None:
        super().__init__()  # torch's own caching stays off: the cache is ``cache``
        self.cache = cache

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        if self.cache.local is not None and same_plan(plan, self.cache.local):
            return UNCHANGED
        self.cache.pending = plan
        return plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Any]:
        c = self.cache
        if c.all_local is None or len(c.all_local) != len(all_plans):
            global_plan, metadata = super().create_global_plan(all_plans)
            c.all_local, c.global_plan, c.metadata = all_plans, global_plan, metadata
            return global_plan, metadata
        if not any(p.usable for p in all_plans):  # no rank's plan changed: scatter nothing
            self.global_plan, self.metadata = c.global_plan, c.metadata
            return [UNCHANGED] * len(all_plans), c.metadata
        merged = [old if not new.usable else new for old, new in zip(c.all_local, all_plans, strict=True)]
        global_plan, metadata = super().create_global_plan(merged)
        delta = [UNCHANGED if same_plan(old, new) else new
                 for old, new in zip(c.global_plan, global_plan, strict=True)]
        c.all_local, c.global_plan, c.metadata = merged, global_plan, metadata
        return delta, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        c = self.cache
        if new_plan.usable:
            c.final = new_plan
        elif c.final is None:
            raise CheckpointError("a save plan came back 'unchanged' but this rank has none cached",
                                  "nothing to do: the next save plans again")
        if c.pending is not None:  # the whole save planned: this rank's plan is the cached one
            c.local, c.pending = c.pending, None
        return super().finish_plan(c.final if not new_plan.usable else new_plan)

    def resolve_data(self, write_item: WriteItem) -> Any:
        data = super().resolve_data(write_item)
        if isinstance(data, torch.Tensor) and data.is_meta:
            raise CheckpointError(
                f"{write_item.index.fqn} was left out of this rank's staging copy but its save plan "
                "changed to have this rank write it; this save is abandoned",
                "nothing to do: the next save plans again and stages all it writes")
        return data


def planner(key: str) -> DefaultSavePlanner:
    return _Planner(_CACHES.setdefault(key, PlanCache()))


def flatten(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` flattened to DCP's dotted keys, as DCP's default planner flattens it."""
    p = DefaultSavePlanner()
    p.set_up_planner(state)
    return p.state_dict


def local_plan(state: dict[str, Any]) -> tuple[SavePlan, dict[str, Any]]:
    """The local plan DCP's default planner makes for ``state`` (not as the coordinator),
    and the flattened state."""
    p = DefaultSavePlanner()
    p.set_up_planner(state)
    return p.create_local_plan(), p.state_dict


def written_elsewhere(key: str, state: dict[str, Any]) -> frozenset[str] | None:
    """The fully qualified names of the plain tensors in ``state`` that the cached plans have
    another rank write, or None if ``state`` does not plan as the cached local plan."""
    c = _CACHES.get(key)
    if c is None or c.local is None or c.final is None:
        return None
    sig = signature(state)
    kept = c.answer
    if sig is not None and kept is not None and kept[0] == sig and kept[1] is c.local and kept[2] is c.final:
        return kept[3]
    answer = _planned_elsewhere(c, state)
    c.answer = None if sig is None else (sig, c.local, c.final, answer)
    return answer


def _planned_elsewhere(c: PlanCache, state: dict[str, Any]) -> frozenset[str] | None:
    """``written_elsewhere``'s answer, from planning ``state`` again."""
    try:  # never raise here: DCP reports what is wrong itself when it saves
        plan, flat = local_plan(state)
    except Exception:  # noqa: BLE001 - e.g. a duplicated flattened key: stage everything
        return None
    if not same_plan(plan, c.local):
        return None
    mine = {item.index.fqn for item in c.final.items}
    return frozenset(item.index.fqn for item in c.local.items if item.type == WriteItemType.TENSOR
                     and item.index.fqn not in mine and type(flat.get(item.index.fqn)) in (torch.Tensor, torch.nn.Parameter))


def signature(obj: Any) -> tuple | None:
    """Pure: what DCP's local save plan of ``obj`` depends on, as a value to compare: the
    containers' types, keys and lengths; a tensor's type, shape, dtype, layout, autograd flag
    and pinning (``TensorProperties``); a DTensor's placements, mesh (this object) and local
    tensor's; for any other value its type. None for an object that plans itself
    (``__create_write_items__``) other than a DTensor, or another tensor subclass."""
    try:
        return _signature(obj)
    except _PlansItself:
        return None


class _PlansItself(Exception):
    pass


_SCALARS = frozenset({int, float, bool, str, bytes, type(None)})


def _signature(obj: Any) -> tuple:
    kind = type(obj)
    if kind in _SCALARS:
        return (kind,)
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        return (kind, obj.shape, obj.dtype, obj.layout, obj.requires_grad, obj.is_pinned())
    if isinstance(obj, dict):
        return (kind, tuple((k, _signature(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return (kind, tuple(_signature(v) for v in obj))
    if isinstance(obj, DTensor):
        return (DTensor, obj.shape, tuple(obj.placements), id(obj.device_mesh), _signature(obj.to_local()))
    if isinstance(obj, torch.Tensor) or hasattr(obj, "__create_write_items__"):
        raise _PlansItself
    return (kind,)


def forget(key: str) -> None:
    _CACHES.pop(key, None)
