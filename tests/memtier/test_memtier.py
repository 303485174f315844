"""The in-memory tier's decisions and its snapshot format, in one process.

Slots are real memory files (``memfd_create``) opened through ``/proc`` as workers open
their agent's; the other ranks of a collective restore are played by ``gather``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from elastic_harness.data.sampler import DataState
from elastic_harness.memtier import snapshot
from elastic_harness.memtier.cadence import WINDOW, Cadence, interval, probe_on, snapshot_due
from elastic_harness.memtier.choose import MEMORY, Offer, choose, offers_of
from elastic_harness.memtier.host import describe, slot_paths
from elastic_harness.memtier.peer import Wire, encode_offers
from elastic_harness.memtier.region import Region
from elastic_harness.memtier.slots import HEADER_SIZE, Header, next_slot
from elastic_harness.memtier.tier import MemoryTier, Place
from elastic_harness.runtime.state import TrainState, build_state

pytestmark = pytest.mark.timeout(60)


# ----- pure decisions --------------------------------------------------------------------

def _own(rank, *steps, world=2):
    return [Offer(s, world, rank, b"d" * 32, False) for s in steps]


def _step(offers, world_size=2):
    plan = choose(offers, world_size=world_size, replicated=False)
    return plan.step if plan.source == MEMORY else None


def test_the_newest_step_every_rank_holds_is_used():
    assert _step([_own(0, 4, 5), _own(1, 4, 5)]) == 5
    assert _step([_own(0, 4, 5), _own(1, 3, 4)]) == 4  # a rank died before snapshotting step 5
    assert _step([_own(0, 4, 5), []]) is None  # a rank without memory (a new node)
    assert _step([_own(0, 9), _own(1, 8)]) is None
    assert _step([], world_size=0) is None


def test_only_published_snapshots_of_this_rank_and_world_size_are_usable():
    d = b"d" * 32
    headers = [Header(True, 7, 2, 1, 10, 5, d), Header(True, 6, 2, 1, 10, 5, d), None]
    assert [o.step for o in offers_of(headers)] == [7, 6]
    torn = [Header(False, 8, 2, 1, 10, 5, d), Header(True, 7, 2, 1, 10, 5, d)]
    assert [o.step for o in offers_of(torn)] == [7]  # killed while writing step 8
    assert _step([_own(0, 7), offers_of(headers)], world_size=2) == 7
    assert _step([_own(0, 7), _own(1, 7), offers_of(headers)], world_size=3) is None  # resized
    assert _step([offers_of(headers), _own(1, 7)]) is None  # another rank's memory


def test_slots_alternate_so_the_newest_snapshot_is_never_overwritten():
    assert next_slot(None, 2) == 0
    assert [next_slot(s, 2) for s in (0, 1)] == [1, 0]


def test_snapshots_follow_the_interval_and_every_durable_save():
    due = [s for s in range(1, 10) if snapshot_due(3, s, last=(s - 1) // 3 * 3, forced=False)]
    assert due == [3, 6, 9]
    assert snapshot_due(3, 4, last=3, forced=True)  # memory is never older than storage
    assert not snapshot_due(0, 4, last=0, forced=True)  # the tier is off
    assert snapshot_due(2, 7, last=5, forced=False)  # counted from the last one, not from 0


def test_the_interval_keeps_the_copy_within_its_share_of_step_time():
    assert interval(copy_s=0.010, step_s=0.040, budget=0.03, least=1) == 9  # 10 ms / 9 <= 1.2 ms
    assert interval(copy_s=0.0005, step_s=0.040, budget=0.03, least=1) == 1  # cheap: every step
    assert interval(copy_s=0.0005, step_s=0.040, budget=0.03, least=4) == 4  # never below memory_every
    assert interval(copy_s=0.010, step_s=0.040, budget=0.0, least=2) == 2  # budget 0: fixed
    assert interval(copy_s=0.010, step_s=0.0, budget=0.03, least=1) == 1  # nothing measured yet
    assert interval(copy_s=0.0012, step_s=0.040, budget=0.03, least=1) == 1  # exactly on budget


def test_cadence_proposes_from_medians_and_counts_from_the_start():
    c = Cadence(every=1, budget=0.03)
    assert c.proposal(1) == 1  # nothing measured: memory_every
    for s in (9.0, 2.0, 0.04, 0.04, 0.04):  # the first step is left out, one slow one outvoted
        c.step_took(s)
    for s in (0.5, 0.5, 0.01, 0.01, 0.01):  # the first touch of each slot is left out
        c.snapshot_took(s)
    assert c.medians() == (0.0, 0.04), "too few copies measured yet"
    for s in (0.01,):
        c.snapshot_took(s)
    assert c.medians() == (0.01, 0.04)
    assert c.proposal(1) == 9
    c.snapshot_took(0.0085)  # median 10 ms -> 8.5 ms: 8 would do, 9 stays (no flapping)
    c.snapshot_took(0.0085)
    assert c.proposal(1) == 9
    for _ in range(WINDOW):
        c.snapshot_took(0.001)  # the copy got much cheaper: every step
    assert c.proposal(1) == 1


def test_a_probe_turns_the_tier_off_in_every_second_block():
    """checkpoint.memory_probe: blocks of B steps on, off, on, ... from step 1; the interval
    measured meanwhile is kept for the next on block."""
    assert [probe_on(s, 3) for s in range(1, 10)] == [True] * 3 + [False] * 3 + [True] * 3
    assert all(probe_on(s, 0) for s in range(1, 10))
    c = Cadence(every=1, budget=0.03, probe=3)
    for _ in range(9):
        c.step_took(0.04)
    for _ in range(6):
        c.snapshot_took(0.0024)  # need 2
    assert [c.proposal(s) for s in range(1, 8)] == [2, 2, 2, 0, 0, 0, 2]
    c.start(0)
    c.agree(0)
    assert not c.due(5, forced=True), "off: not even with a durable save"


def test_the_interval_does_not_flip_between_neighbours():
    c = Cadence(every=1, budget=0.03)
    for _ in range(9):
        c.step_took(0.045)
    for _ in range(10):
        c.snapshot_took(0.0027)  # need = 2.0: a snapshot every 2 steps
    assert c.proposal(1) == 2
    seen = set()
    for copy in (0.00285, 0.0027, 0.0029, 0.00275) * 4:  # need wanders over 2.0-2.15
        for _ in range(WINDOW):
            c.snapshot_took(copy)
        seen.add(c.proposal(1))
    assert seen == {2}
    for _ in range(WINDOW):
        c.snapshot_took(0.0045)  # need 3.3: over budget, raised
    assert c.proposal(1) == 4
    c.start(20)  # resumed at step 20
    assert c.agree(9) and not c.agree(9)  # a change is reported once
    assert not c.due(21, forced=False) and c.due(29, forced=False)
    c.taken(29)
    assert not c.due(30, forced=False) and c.due(30, forced=True)


def test_the_interval_does_not_flip_at_the_floor():
    """``need`` wandering around 1.0 with ``every`` 1 (the quickstart's "every 1/2 step(s)"
    line, ~10 times a run): once raised to 2 it stays while 2 is not far too many."""
    c = Cadence(every=1, budget=0.03)
    for _ in range(9):
        c.step_took(0.040)
    changes, last = 0, None
    for copy in (0.00135, 0.0011, 0.00140, 0.00105, 0.0013, 0.0010) * 5:  # need 0.83-1.17
        for _ in range(WINDOW):
            c.snapshot_took(copy)
        k = c.proposal(1)
        changes, last = changes + (k != last), k
    assert changes <= 2, "set once, raised at most once"
    for _ in range(WINDOW):
        c.snapshot_took(0.0006)  # need 0.5: 2 is far more than needed, lowered
    assert c.proposal(1) == 1


def test_the_interval_settles_when_copy_times_are_bimodal():
    """Measured on the quickstart: copies alternate between ~2 and ~4 ms (each slot its
    own), so a median of a few flips between the modes and the interval between 1 and 2
    every few steps. The copy time's estimate is a trimmed mean: it settles."""
    c = Cadence(every=1, budget=0.03)
    for _ in range(70):
        c.step_took(0.090)
    changes, last = 0, None
    for i in range(200):  # 200 snapshots: 1.9, 3.9, 1.9, ... with small noise
        c.snapshot_took((0.0019, 0.0039)[i % 2] + 0.0001 * ((i * 7) % 3) + (0.0021 if i % 5 == 0 else 0))
        k = c.proposal(1)
        changes, last = changes + (k != last), k
    assert changes <= 2, changes


def test_header_round_trip_and_foreign_bytes():
    h = Header(True, 12, 4, 3, 1000, 77, bytes(range(32)))
    assert Header.unpack(h.pack() + b"\0" * 10) == h
    assert Header.unpack(b"\0" * HEADER_SIZE) is None  # an empty slot
    assert Header.unpack(b"short") is None


def test_workers_find_their_slots_in_the_agents_description():
    value = describe(41, [[3, 4], [5, 6]])
    assert slot_paths(value, 1) == ["/proc/41/fd/5", "/proc/41/fd/6"]
    assert slot_paths(value, 2) == [] and slot_paths("", 0) == [] and slot_paths("x:1", 0) == []


# ----- slots in real memory files --------------------------------------------------------

# (the ``slots`` fixture: tests/memtier/conftest.py)


def _state(hidden: int = 8, steps: int = 3):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    train = TrainState(DataState(0, 100), world_size=2)
    extra = {"ema": torch.zeros(3), "note": "n"}
    for i in range(steps):
        _train_step(model, optim, i)
        sched.step()
    train.step, train.data = steps, train.data.advance(30 * steps)
    extra["ema"] += steps
    return build_state(model, optim, train, scheduler=sched, extra={"ema": extra}), model, optim


def _train_step(model, optim, i):
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(i))
    model(x).square().sum().backward()
    optim.step()
    optim.zero_grad()


OK, FAIL = [0], [1]  # a rank's flag in the restore's agreement gathers


def _held(*steps, rank=0, world=2):
    """What the other rank contributes to the offers gather: its own snapshots of ``steps``."""
    return encode_offers(_own(rank, *steps, world=world))


def _published(regions):
    """Per slot, the step it holds published, or None."""
    return [h.step if h is not None and h.published else None for h in (r.header() for r in regions)]


def _tier(regions, rank=1, others=(), world_size=2):
    """Rank ``rank`` of 2; ``others`` is what the other rank contributes to each gather."""
    replies = list(others)

    def gather(value):
        other = replies.pop(0)
        return [other, value] if rank == 1 else [value, other]

    def no_p2p(tensor, peer):
        raise AssertionError("no transfer expected")

    return MemoryTier(regions, Place(rank, world_size, Wire(gather, no_p2p, no_p2p)), warn=lambda m: None)


def test_a_snapshot_restores_every_entry_bit_for_bit(slots):
    state, model, optim = _state()
    # The data position goes into the skeleton as ints: no tensors to make, pickle and copy.
    assert {type(v) for v in snapshot.state_dicts(state)["train"].values()} == {int}
    _tier(slots).save(3, state)
    fresh, model2, optim2 = _state(steps=0)
    restored = _tier(slots, others=[_held(3), OK, OK]).restore(fresh)
    assert restored is not None and restored.step == 3
    assert fresh["train"].step == 3 and fresh["train"].data == state["train"].data
    assert fresh["sched"].obj.state_dict() == state["sched"].obj.state_dict()
    assert torch.equal(fresh["extra.ema"]["ema"], state["extra.ema"]["ema"])
    assert optim2.state_dict()["param_groups"] == optim.state_dict()["param_groups"]
    _train_step(model, optim, 9)
    _train_step(model2, optim2, 9)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)  # the next step is the same step


def test_nothing_common_means_storage_and_an_untouched_fresh_state(slots):
    state, *_ = _state()
    _tier(slots).save(3, state)
    fresh, _, optim = _state(steps=0)
    assert _tier(slots, others=[_held()]).restore(fresh) is None  # the other rank has no memory
    # The live state_dict() was never taken: it would have initialised the optimizer (a zero
    # step) on this rank only, before a fresh start.
    assert not optim.state
    assert _published(slots) == [None, None]  # stale lineage


def test_a_rank_killed_while_writing_keeps_its_previous_snapshot(slots):
    state, *_ = _state()
    tier = _tier(slots)
    tier.save(3, state)
    slots[1].begin(HEADER_SIZE + 10)  # the next save started, then the process died
    assert _published(slots) == [3, None]
    tier.save(4, state)  # the next process writes the slot not holding its newest snapshot
    assert _published(slots) == [3, 4]
    tier.save(5, state)
    assert _published(slots) == [5, 4]


def test_a_snapshot_of_another_layout_stops_the_generation_and_clears_memory(slots):
    state, *_ = _state(hidden=8)
    _tier(slots).save(3, state)
    other, *_ = _state(hidden=16, steps=0)
    with pytest.raises(RuntimeError, match="does not fit"):
        _tier(slots, others=[_held(3), OK, OK]).restore(other)
    assert _published(slots) == [None, None]  # storage next


def test_a_peer_that_failed_to_load_stops_every_rank(slots):
    state, *_ = _state()
    _tier(slots).save(3, state)
    fresh, *_ = _state(steps=0)
    with pytest.raises(RuntimeError, match=r"failed on rank\(s\) \[0\]"):
        _tier(slots, others=[_held(3), OK, FAIL]).restore(fresh)
    assert _published(slots) == [None, None]


def test_tied_weights_and_batchnorm_buffers_come_back_bit_for_bit(slots):
    def build():
        torch.manual_seed(0)
        emb = nn.Embedding(6, 4)
        head = nn.Linear(4, 6, bias=False)
        head.weight = emb.weight  # tied: the state dict holds the same storage twice
        model = nn.Sequential(emb, nn.BatchNorm1d(4), head)
        optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, optim

    model, optim = build()
    for i in range(3):  # moves the BatchNorm running stats and its batch counter
        model(torch.arange(6) % (i + 2)).sum().backward()
        optim.step()
        optim.zero_grad()
    state = build_state(model, optim, TrainState(DataState(0, 100), world_size=2, step=3))
    _tier(slots).save(3, state)
    model2, optim2 = build()
    fresh = build_state(model2, optim2, TrainState(DataState(0, 100), world_size=2))
    assert _tier(slots, others=[_held(3), OK, OK]).restore(fresh).step == 3
    for (k, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    assert model2[2].weight is model2[0].weight  # still tied after the restore


def test_a_snapshot_whose_plain_keys_differ_does_not_fit(slots):
    state, *_ = _state()
    _tier(slots).save(3, state)
    fresh, *_ = _state(steps=0)
    fresh["extra.ema"]["added"] = 1  # same tensors, one more plain value: another layout
    with pytest.raises(RuntimeError, match="keys differ"):
        _tier(slots, others=[_held(3), OK, OK]).restore(fresh)


def test_misfit_names_the_first_difference():
    t = torch.zeros(2, 3)
    cap = snapshot.capture_trees({"m": {"w": t, "n": 1, "l": [t, 2]}})
    saved = snapshot.unpack(cap.skeleton)
    assert saved["m"]["l"][0] == saved["m"]["w"]  # one tensor, one reference (the memo)
    assert len(cap.tensors) == 1 and cap.data_len == 64
    assert snapshot.misfit(saved, {"m": {"w": t, "n": 5, "l": [t, 7]}}) is None  # values may differ
    assert "m/w" in snapshot.misfit(saved, {"m": {"w": torch.zeros(3, 2), "n": 1, "l": [t, 2]}})
    assert "m/l" in snapshot.misfit(saved, {"m": {"w": t, "n": 1, "l": [t]}})
    assert "m/n" in snapshot.misfit(saved, {"m": {"w": t, "n": t, "l": [t, 2]}})
    assert "m/w" in snapshot.misfit(saved, {"m": {"w": t.double(), "n": 1, "l": [t, 2]}})


def test_key_order_does_not_matter_to_the_layout_check():
    """An optimizer's state lists parameters in the order they first got state, which a
    fresh one (state created for all at once) need not share."""
    t = torch.zeros(2)
    saved = snapshot.unpack(snapshot.capture_trees({"s": {1: {"m": t}, 0: {"m": t}}}).skeleton)
    assert snapshot.misfit(saved, {"s": {0: {"m": t}, 1: {"m": t}}}) is None
    assert "keys differ" in snapshot.misfit(saved, {"s": {0: {"m": t}, 2: {"m": t}}})


def test_a_slot_asked_to_pin_without_cuda_stays_a_plain_mapping(tmp_path):
    """``begin(pin=True)`` (a snapshot of CUDA tensors) registers the mapping with CUDA; with
    no GPU it is the same plain mapping, sized and writable, and close is clean."""
    path = tmp_path / "slot"
    path.write_bytes(b"")
    region = Region(str(path))
    data = region.begin(HEADER_SIZE + 4096, pin=True)
    data[HEADER_SIZE:HEADER_SIZE + 3].copy_(torch.tensor([1, 2, 3], dtype=torch.uint8))
    assert data.numel() >= HEADER_SIZE + 4096 and region.data().data_ptr() == data.data_ptr()
    assert bool(region._registered) == torch.cuda.is_available()
    grown = region.begin(HEADER_SIZE + 8192, pin=True)
    assert grown.numel() >= HEADER_SIZE + 8192 and grown[HEADER_SIZE:HEADER_SIZE + 3].tolist() == [1, 2, 3]
    region.close()
    assert not region._registered
