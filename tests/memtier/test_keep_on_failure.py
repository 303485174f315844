"""A failing rank keeps the step it last completed (``checkpoint.memory_on_failure``), in one
process: ``MemoryTier.arm`` after a step, ``keep_armed`` on the way down, and when it must not.

Slots are real memory files, as in ``test_memtier`` (whose helpers these tests share).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from elastic_harness.memtier import snapshot
from elastic_harness.memtier.cadence import Cadence
from elastic_harness.memtier.peer import Rules
from elastic_harness.runtime.resume import memory_covers_failure
from tests.memtier.test_memtier import OK, _held, _published, _state, _tier, _train_step

pytestmark = pytest.mark.timeout(60)


def test_a_failing_rank_keeps_the_step_it_was_armed_with(slots):
    state, model, optim = _state()
    tier = _tier(slots)
    tier.save(2, state)
    tier.arm(3, state)
    assert tier.keep_armed() == 3
    assert sorted(s for s in _published(slots) if s is not None) == [2, 3]
    assert tier.keep_armed() is None  # once
    fresh, model2, _ = _state(steps=0)
    assert _tier(slots, others=[_held(3), OK, OK]).restore(fresh).step == 3
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_state_changed_since_arming_is_not_kept(slots):
    """An optimizer step after ``arm`` (its pre-hook disarms; an in-place change the version
    counters see is caught too): nothing is written, the older snapshot stays the newest."""
    state, model, optim = _state()
    tier = _tier(slots)
    tier.save(2, state)
    tier.arm(3, state)
    _train_step(model, optim, 9)  # AdamW without fused kernels bumps every version counter
    assert tier.keep_armed() is None
    tier.arm(4, state)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    assert tier.keep_armed() is None
    tier.arm(5, state)
    tier.disarm()  # what the hook's optimizer pre-hook does, fused kernels or not
    assert tier.keep_armed() is None
    assert _published(slots) == [2, None]


def test_the_kept_step_holds_the_plain_values_of_when_it_was_armed(slots):
    """Plain values (a scheduler's position, the data cursor) that move after ``arm`` without
    touching a tensor are the armed step's in the kept snapshot, as in a snapshot taken then."""
    state, model, optim = _state()
    tier = _tier(slots)
    tier.arm(3, state)
    before = state["sched"].obj.state_dict()
    state["sched"].obj.step()
    state["train"].step = 4
    assert tier.keep_armed() == 3
    fresh, *_ = _state(steps=0)
    assert _tier(slots, others=[_held(3), OK, OK]).restore(fresh).step == 3
    assert fresh["sched"].obj.state_dict() == before and fresh["train"].step == 3


def test_a_snapshot_of_the_armed_step_reuses_its_capture(slots, monkeypatch):
    state, *_ = _state()
    tier = _tier(slots)
    tier.arm(3, state)

    def no_capture(_):
        raise AssertionError("the armed capture was not reused")

    monkeypatch.setattr(snapshot, "capture", no_capture)
    assert tier.save(3, state)
    assert tier.keep_armed() == 3  # already published: nothing to write
    assert _published(slots) == [3, None]


def test_failing_ranks_keep_their_step_only_for_replicated_state_that_only_the_optimizer_changes(slots):
    tier = _tier(slots)
    tier.rules = Rules(replicated=True)
    mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    assert memory_covers_failure(tier, mlp, 2, True)
    assert not memory_covers_failure(tier, mlp, 2, False)  # checkpoint.memory_on_failure: false
    assert not memory_covers_failure(tier, mlp, 1, True)  # nobody survives a lone rank
    assert not memory_covers_failure(None, mlp, 2, True)  # the tier off
    bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))  # running statistics move in forward
    assert not memory_covers_failure(tier, bn, 2, True)
    tied = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    tied[1].weight = tied[0].weight
    assert memory_covers_failure(tier, tied, 2, True)
    tier.rules = Rules(sharded=True)  # FSDP: a lost rank's shard is nobody else's
    assert not memory_covers_failure(tier, mlp, 2, True)


def test_covered_snapshots_spend_a_third_of_the_budget_while_arming_fits_the_rest():
    c = Cadence(every=1, budget=0.03)
    for _ in range(8):
        c.step_took(0.040)
        c.snapshot_took(0.004)
    assert c.proposal(10) == 4 and not c.arming(10)  # 4 ms / 4 <= 3 % of 40 ms
    c.cover(True)
    assert c.arming(11)  # not measured yet
    for _ in range(4):
        c.arm_took(0.0001)
    assert c.arming(12) and c.proposal(12) == 10  # arming 0.1 ms a step: snapshots get 1 %
    for _ in range(8):
        c.arm_took(0.001)  # 1 ms a step is more than the 2 % arming may take
    assert not c.arming(13) and c.arming(16)  # still timed every 16 steps
    assert c.proposal(17) == 4  # and the snapshots spend the whole budget again


def test_a_probe_off_block_leaves_the_tier_unarmed():
    c = Cadence(every=1, budget=0.03, probe=2)
    assert not c.active  # nothing agreed before the first step's vote
    c.agree(c.proposal(1))
    assert c.active
    c.agree(c.proposal(3))  # steps 3-4: the probe's off block
    assert not c.active

