"""Save plans cached per checkpoint manager, so a periodic save does not plan from scratch.

Every DCP save plans what each rank writes: local plans, gathered on the coordinator,
deduplicated into a global plan, scattered back. With ``enable_plan_caching`` a rank whose
local plan equals the previous save's sends an empty plan and reuses the cached final plan,
and the coordinator reuses the cached global plan and metadata; a changed plan is planned
again. torch keeps that cache in class-level dicts keyed by ``_cached_plans_key`` (the
class name by default), so two managers in one process (the bench has several) would share
entries: each manager gets its own key, and ``forget`` drops its entries on close.

The cached plans also say, before a save, which of this rank's plain tensors another rank
will write (DDP replicas: DCP has each written once): ``written_elsewhere`` returns them
when this state plans exactly as the cached local plan. If every rank says so, the cached
plans are what DCP will use, so the stager may leave those tensors out (a placeholder with
their shape instead of a copy): half the staging copy for two DDP ranks. The planner
refuses to write a placeholder, should a plan ever change unseen.

Call order: ``written_elsewhere(key, state)`` before staging (then agree across ranks);
``planner(key)`` for every save of one manager (a new planner each time: it holds that
save's state dict); ``forget(key)`` once, when the manager closes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import create_default_local_save_plan
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import _compare_save_plans

from elastic_harness.deps import require_torch
from elastic_harness.errors import CheckpointError

_CACHES = ("_cached_save_plan", "_cached_all_plans", "_cached_global_plan", "_cached_metadata",
           "_cached_final_save_plan")


class _Planner(DefaultSavePlanner):
    def resolve_data(self, write_item: WriteItem) -> Any:
        data = super().resolve_data(write_item)
        if isinstance(data, torch.Tensor) and data.is_meta:
            raise CheckpointError(
                f"{write_item.index.fqn} was left out of this rank's staging copy but its save plan "
                "changed to have this rank write it; this save is abandoned",
                "nothing to do: the next save plans again and stages all it writes")
        return data


def planner(key: str) -> DefaultSavePlanner:
    require_torch("DefaultSavePlanner._cached_plans_key")
    p = _Planner(enable_plan_caching=True)
    p._cached_plans_key = key
    return p


def written_elsewhere(key: str, state: dict[str, Any]) -> frozenset[str] | None:
    """The fully qualified names of the plain tensors in ``state`` that the cached plans have
    another rank write, or None if ``state`` does not plan as the cached local plan."""
    cached, final = SavePlanner._cached_save_plan.get(key), SavePlanner._cached_final_save_plan.get(key)
    if cached is None or final is None:
        return None
    try:  # never raise here: the ranks are about to agree, and DCP reports what is wrong itself
        flat, _ = flatten_state_dict(state)
        same = _compare_save_plans(create_default_local_save_plan(flat, False), cached)
    except Exception:  # noqa: BLE001 - e.g. a duplicated flattened key: stage everything
        return None
    if not same:
        return None
    mine = {item.index.fqn for item in final.items}
    return frozenset(item.index.fqn for item in cached.items if item.type == WriteItemType.TENSOR
                     and item.index.fqn not in mine and type(flat.get(item.index.fqn)) in (torch.Tensor, torch.nn.Parameter))


def forget(key: str) -> None:
    for name in _CACHES:
        getattr(SavePlanner, name, {}).pop(key, None)
