"""Save plans cached per checkpoint manager, so a periodic save does not plan from scratch.

Every DCP save plans what each rank writes: local plans, gathered on the coordinator,
deduplicated into a global plan, scattered back. With ``enable_plan_caching`` a rank whose
local plan equals the previous save's sends an empty plan and reuses the cached final plan,
and the coordinator reuses the cached global plan and metadata; a changed plan is planned
again. torch keeps that cache in class-level dicts keyed by ``_cached_plans_key`` (the
class name by default), so two managers in one process (the bench has several) would share
entries: each manager gets its own key, and ``forget`` drops its entries on close.

Call order: ``planner(key)`` for every save of one manager (a new planner each time: it
holds that save's state dict); ``forget(key)`` once, when the manager closes.
"""

from __future__ import annotations

from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner

_CACHES = ("_cached_save_plan", "_cached_all_plans", "_cached_global_plan", "_cached_metadata",
           "_cached_final_save_plan")


def planner(key: str) -> DefaultSavePlanner:
    p = DefaultSavePlanner(enable_plan_caching=True)
    p._cached_plans_key = key
    return p


def forget(key: str) -> None:
    for name in _CACHES:
        getattr(SavePlanner, name, {}).pop(key, None)
