"""The save plans' cache (``checkpoint.plans``) on one process: DCP's real planner, no ranks.

``written_elsewhere`` answers from the cached plans; the answer is kept with the state's
``signature`` and given again while nothing DCP plans from changed (values may), and worked
out again when anything it plans from did (a shape, the autograd flag, a key).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from elastic_harness.checkpoint import plans

pytestmark = pytest.mark.timeout(60)


def _state(rows: int = 4) -> dict:
    return {"model": {"w": torch.ones(rows, 3), "b": torch.zeros(3)}, "train": {"step": torch.tensor(7)},
            "sched": {"last_epoch": 3, "lrs": [0.1, 0.2]}}


def _planned(key: str, state: dict, tmp_path) -> None:
    """One real DCP save through the cache's planner: the cache now holds its plans."""
    dcp.save(state, checkpoint_id=str(tmp_path / key), planner=plans.planner(key), no_dist=True)


def _counting(monkeypatch) -> list:
    """Count the local plannings ``written_elsewhere`` does (the real planner still runs)."""
    calls: list = []
    real = plans.local_plan

    def local_plan(state):
        calls.append(1)
        return real(state)

    monkeypatch.setattr(plans, "local_plan", local_plan)
    return calls


def test_the_answer_is_kept_while_nothing_planned_from_changes(tmp_path, monkeypatch):
    key = "keep"
    state = _state()
    _planned(key, state, tmp_path)
    planned = _counting(monkeypatch)
    try:
        first = plans.written_elsewhere(key, state)
        assert first == frozenset() and len(planned) == 1  # one rank writes everything
        state["model"]["w"].add_(1.0)  # values move between saves ...
        state["sched"]["last_epoch"] = 4
        assert plans.written_elsewhere(key, state) == first
        assert plans.written_elsewhere(key, _state()) == first  # new objects, the same plan
        assert len(planned) == 1  # ... the kept answer, not planned again
    finally:
        plans.forget(key)


@pytest.mark.parametrize("change", ["shape", "requires_grad", "key", "container"])
def test_any_change_the_plan_depends_on_plans_again(tmp_path, monkeypatch, change):
    key = f"change-{change}"
    state = _state()
    _planned(key, state, tmp_path)
    planned = _counting(monkeypatch)
    try:
        assert plans.written_elsewhere(key, state) == frozenset()
        if change == "shape":
            state["model"]["w"] = torch.ones(5, 3)
        elif change == "requires_grad":
            state["model"]["w"].requires_grad_(True)
        elif change == "key":
            state["model"]["extra"] = torch.ones(2)
        else:  # a list of plain values is one pickled item; with a tensor in it, one item each
            state["sched"]["lrs"] = [torch.tensor(0.1), 0.2]
        assert plans.written_elsewhere(key, state) is None  # no longer plans as cached: copy it all
        assert len(planned) == 2
    finally:
        plans.forget(key)


def test_a_tensor_subclass_that_plans_itself_has_no_signature():
    class Own(torch.Tensor):
        pass

    own = torch.ones(2).as_subclass(Own)
    assert plans.signature({"a": own}) is None
    assert plans.signature({"a": torch.ones(2), "b": [1, "x", None]}) is not None
