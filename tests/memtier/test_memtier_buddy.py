"""Buddy copies (issue 26 item 2): who keeps whose copy, which pieces a restore may use, the
fallbacks to storage, what travels, and the in-memory reshard (``memtier.buddy``,
``memtier.choose``, ``memtier.peer``, ``memtier.reshard``). All in one process, fast."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from elastic_harness.memtier import buddy, reshard
from elastic_harness.memtier.choose import BUDDY, MEMORY, STORAGE, Offer, choose
from elastic_harness.memtier.peer import (
    decode_offers,
    decode_skeleton,
    encode_offers,
    encode_skeleton,
)
from elastic_harness.memtier.slots import Header
from elastic_harness.memtier.snapshot import TensorRef, Unsupported
from elastic_harness.runtime.topology import Topology

pytestmark = pytest.mark.timeout(60)

D, E = b"d" * 32, b"e" * 32
GEN, OTHER_GEN = 0xABC, 0xDEF


def own(step, world, rank, gen=GEN, digest=D):
    return Offer(step, world, rank, digest, False, gen)


def copy(step, world, rank, gen=GEN, digest=D):
    return Offer(step, world, rank, digest, False, gen, buddy=True)


# ----- the ring -------------------------------------------------------------------------------

def test_each_rank_keeps_the_same_local_rank_of_the_next_node():
    # 3 nodes x 2 ranks: node 0 keeps node 1's, node 1 node 2's, node 2 node 0's.
    assert [buddy.source_of(r, 6, 2) for r in range(6)] == [2, 3, 4, 5, 0, 1]
    assert all(buddy.holder_of(buddy.source_of(r, 6, 2), 6, 2) == r for r in range(6))
    assert all(buddy.holder_of(r, 6, 2) // 2 != r // 2 for r in range(6))  # never on its own node
    assert buddy.active(2, 1, sharded=True)
    assert not buddy.active(2, 2, sharded=True)  # one node: nothing to survive
    assert not buddy.active(4, 2, sharded=False)  # DDP: the survivors hold full replicas already
    assert buddy.due(anyone_busy=False, snapshot_taken=True)
    assert not buddy.due(anyone_busy=True, snapshot_taken=True)


# ----- what a restore may use ---------------------------------------------------------------

def test_a_lost_node_is_covered_by_its_buddy_copy_at_the_newest_common_step():
    # 2 nodes x 1: rank 1 lost after step 36's snapshot but before its copy of 36 arrived.
    plan = choose([[own(36, 2, 0), own(35, 2, 0), copy(35, 2, 1), copy(34, 2, 1)]], world_size=1,
                  replicated=False)
    assert (plan.source, plan.step, plan.saved_world_size, plan.providers) == (BUDDY, 35, 2, (0, 0))
    assert plan.generation == GEN and plan.digests == (D, D)


def test_a_mesh_layout_at_another_world_size_is_never_resharded_in_memory():
    # HSDP grown back from 1 to 2 replicas: node 0's snapshots cover the old world, but a 2-D
    # DTensor is not the 1-D row reshard's to do: storage (DCP reshards), no restart spent.
    offers = [[own(79, 2, 0)], [own(79, 2, 1)], [], []]
    assert choose(offers, world_size=4, replicated=False).source == BUDDY
    plan = choose(offers, world_size=4, replicated=False, sharded=False)
    assert plan.source == STORAGE
    same = [[own(35, 2, 0)], [own(35, 2, 1)]]  # an unchanged mesh still restores from memory
    assert choose(same, world_size=2, replicated=False, sharded=False).source == MEMORY


def test_a_replacement_node_receives_every_piece_it_lacks_from_the_survivor():
    plan = choose([[], [own(35, 2, 0), copy(35, 2, 1)]], world_size=2, replicated=False)
    assert (plan.source, plan.step, plan.providers) == (BUDDY, 35, (1, 1))
    assert buddy.moves(plan, [[], [own(35, 2, 0), copy(35, 2, 1)]], 2) == [(0, 1, 0), (1, 1, 0)]


def test_own_snapshots_are_preferred_as_providers_and_a_worker_crash_stays_plain_memory():
    offers = [[own(35, 2, 0), copy(35, 2, 1)], [own(35, 2, 1), copy(35, 2, 0)]]
    plan = choose(offers, world_size=2, replicated=False)
    assert (plan.source, plan.step, plan.same_layout) == (MEMORY, 35, True)  # no reshard needed
    plan = choose([*offers, []], world_size=3, replicated=False)  # a node joined: reshard
    assert (plan.source, plan.providers) == (BUDDY, (0, 1))


def test_a_node_lost_with_its_buddy_holder_falls_back_to_storage_and_says_so():
    # 3 nodes x 1: nodes 0 and 1 lost; rank 2 holds its own and rank 0's copy, not rank 1's.
    plan = choose([[own(35, 3, 2), copy(35, 3, 0)]], world_size=1, replicated=False)
    assert plan.source == STORAGE
    assert "rank(s) 1" in plan.reason and "buddy" in plan.reason


def test_pieces_of_another_generation_or_layout_are_never_mixed():
    gens = [[own(35, 2, 0), copy(35, 2, 1, gen=OTHER_GEN)]]
    assert choose(gens, world_size=1, replicated=False).source == STORAGE
    # An older step of one generation is fine when the newest one is not covered.
    older = [[own(35, 2, 0), copy(35, 2, 1, gen=OTHER_GEN), own(34, 2, 0), copy(34, 2, 1)]]
    assert choose(older, world_size=1, replicated=False).step == 34
    no_gen = [[own(35, 2, 0, gen=0), copy(35, 2, 1, gen=0)]]  # written before generations were kept
    assert choose(no_gen, world_size=1, replicated=False).source == STORAGE
    # Under DDP copies never exist, and buddy offers are not taken for replicas either.
    assert choose([[copy(35, 2, 1)]], world_size=1, replicated=True).source == STORAGE


def test_two_copies_of_one_rank_that_disagree_rule_out_that_step():
    offers = [[own(35, 3, 0), copy(35, 3, 1)], [own(35, 3, 1, digest=E), copy(35, 3, 2)]]
    assert choose(offers, world_size=2, replicated=False).source == STORAGE


def test_a_copy_older_than_storage_is_not_used():
    assert buddy.older_than_storage(35, None) is None and buddy.older_than_storage(35, 30) is None
    assert "40" in buddy.older_than_storage(35, 40)


def test_a_bogus_announcement_is_refused():
    M = buddy.MAGIC
    # magic, step, generation, world, rank, tensor bytes, JSON bytes, digest
    ok = [M, 35, GEN, 2, 1, 1000, 200, 0, 0, 0, 0]
    assert buddy.acceptable(ok, world_size=2, source=1, limit=buddy.bound(1000)) is None
    assert "rank 0" in buddy.acceptable([M, 35, GEN, 2, 0, *ok[5:]], world_size=2, source=1, limit=10**6)
    assert "more than" in buddy.acceptable([M, 35, GEN, 2, 1, 10**12, 200, *ok[7:]], world_size=2, source=1,
                                           limit=10**6)
    assert buddy.acceptable([M, 35, GEN, 2, 1, -1, 200, *ok[7:]], world_size=2, source=1, limit=10**6)
    assert buddy.acceptable([M, 35, GEN, 2, 1, 1000, 0, *ok[7:]], world_size=2, source=1, limit=10**6)
    assert buddy.acceptable([M, 35, 0, *ok[3:]], world_size=2, source=1, limit=10**6)
    assert buddy.acceptable([0, *ok[1:]], world_size=2, source=1, limit=10**6)
    assert buddy.acceptable(ok[:-1], world_size=2, source=1, limit=10**6)


# ----- what travels -----------------------------------------------------------------------------

def test_offers_keep_generation_and_kind_and_headers_keep_generation():
    offers = [own(35, 2, 0), copy(34, 2, 1, gen=2**47)]
    assert decode_offers(encode_offers(offers)) == offers
    h = Header(True, 35, 2, 1, 100, 20, D, generation=2**47)
    assert Header.unpack(h.pack()) == h


def test_a_sharded_skeleton_travels_as_json_with_its_placements():
    skel = {"m": {"w": TensorRef(0, 24, torch.float32, (2, 3), ("dtensor", (5, 3), (Shard(0),))),
                  "b": TensorRef(64, 12, torch.float32, (3,), ("dtensor", (3,), (Replicate(),)))}, "lr": 0.1}
    assert decode_skeleton(encode_skeleton(skel)) == skel
    with pytest.raises(Unsupported):
        encode_skeleton({"w": TensorRef(0, 4, torch.float32, (1,), ("dtensor", (1,), (Partial(),)))})
    with pytest.raises(ValueError):
        decode_skeleton(b'{"s":[0,4,"float32",[1],[1],["X0"]]}')


def test_a_snapshot_never_goes_into_the_slot_a_buddy_copy_needs():
    assert buddy.writable(None, 2, set()) == 0
    assert buddy.writable(0, 2, set()) == 1
    # Slot 1 holds the step of the newest copy every rank finished: the newest snapshot's slot
    # (0) is written again, the copied one stays.
    assert buddy.writable(0, 2, {1}) == 0
    assert buddy.writable(1, 2, {0}) == 1
    # A copy in flight from one slot and the last settled copy in the other: skipped.
    assert buddy.writable(0, 2, {0, 1}) is None


# ----- the reshard ------------------------------------------------------------------------------

def test_rows_tile_the_dimension_as_dtensor_does():
    for size in (0, 1, 5, 7, 16):
        for world in (1, 2, 3, 4):
            parts = [reshard.rows(size, world, r) for r in range(world)]
            assert sum(c for c, _ in parts) == size
            assert all(o == sum(c for c, _ in parts[:r]) or c == 0 for r, (c, o) in enumerate(parts))


@pytest.mark.parametrize(("old", "new"), [(2, 1), (2, 3), (3, 2), (2, 2), (4, 3)])
@pytest.mark.parametrize("dim", [0, 1])
def test_old_shards_fill_exactly_this_ranks_rows(old, new, dim):
    full = torch.arange(7 * 5, dtype=torch.float32).view(7, 5)
    size = full.shape[dim]
    shards = [full.narrow(dim, o, c).contiguous() for c, o in (reshard.rows(size, old, r) for r in range(old))]
    for rank in range(new):
        count, offset = reshard.rows(size, new, rank)
        local = torch.full_like(full.narrow(dim, offset, count), -1.0)
        reshard.copy_rows(local, dim, size, rank, new, shards)
        assert torch.equal(local, full.narrow(dim, offset, count))


def _skeleton(lr=0.1, shape=(3,)):
    return {"m": {"b": TensorRef(0, 12, torch.float32, shape, ("tensor",))}, "t": {"step": 35, "lr": lr}}


def test_plain_values_and_tensors_come_from_old_rank_0():
    data = [torch.tensor([1.0, 2.0, 3.0]).view(torch.uint8), torch.tensor([9.0, 9.0, 9.0]).view(torch.uint8)]
    pieces = [(_skeleton(lr=0.1), data[0], 0), (_skeleton(lr=0.2), data[1], 0)]
    target = {"m": {"b": torch.zeros(3)}, "t": {"step": 0, "lr": 0.0}}
    reshard.check([p[0] for p in pieces], target, 2)
    out = {k: reshard.fill(target[k], [(s[k], d, b) for s, d, b in pieces], rank=0, world_size=1) for k in target}
    assert torch.equal(out["m"]["b"], torch.tensor([1.0, 2.0, 3.0])) and out["t"] == {"step": 35, "lr": 0.1}


def test_a_layout_that_differs_beyond_the_world_size_is_refused_before_any_copy():
    saved = [_skeleton(), _skeleton()]
    for target in ({"m": {"b": torch.zeros(4)}, "t": {}},  # another shape
                   {"m": {"b": torch.zeros(3), "extra": torch.zeros(1)}, "t": {"step": 0, "lr": 0}},
                   {"m": {"b": torch.zeros(3, dtype=torch.float64)}, "t": {"step": 0, "lr": 0}},
                   {"m": {"b": 1.0}, "t": {"step": 0, "lr": 0}}):
        with pytest.raises(reshard.Misfit):
            reshard.check(saved, target, 2)
    with pytest.raises(reshard.Misfit):  # the old ranks' skeletons disagree with each other
        reshard.check([_skeleton(), _skeleton(shape=(2,))], {"m": {"b": torch.zeros(3)}, "t": {"step": 0, "lr": 0}}, 2)


# ----- a restore over a wire: a replacement rank receives every piece ------------------------

class _Net:
    """Two ranks in threads: gather through a barrier, send/recv through queues."""

    def __init__(self, world: int) -> None:
        import queue
        import threading

        self.barrier, self.slots = threading.Barrier(world, timeout=20), [None] * world
        self.queues = {(s, d): queue.Queue() for s in range(world) for d in range(world)}

    def wire(self, rank: int):
        from elastic_harness.memtier.peer import Wire

        def gather(values):
            self.slots[rank] = list(values)
            self.barrier.wait()
            out = [list(v) for v in self.slots]
            self.barrier.wait()
            return out

        def send(t, dst):
            self.queues[(rank, dst)].put(t.clone())

        def recv(t, src):
            t.copy_(self.queues[(src, rank)].get(timeout=20))

        return Wire(gather, send, recv)


def test_a_replacement_rank_receives_every_old_piece_and_both_restore_the_same_step():
    import threading

    from torch import nn

    from elastic_harness.data.sampler import DataState
    from elastic_harness.memtier import snapshot
    from elastic_harness.memtier.host import HostSlots, slot_paths
    from elastic_harness.memtier.region import Region
    from elastic_harness.memtier.slots import HEADER_SIZE
    from elastic_harness.memtier.tier import MemoryTier, Place
    from elastic_harness.runtime.state import TrainState, build_state

    def state(trained: bool):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        optim = torch.optim.AdamW(model.parameters(), lr=0.01)
        train = TrainState(DataState(0, 100), world_size=2)
        if trained:
            model(torch.ones(3, 4)).sum().backward()
            optim.step()
            train.step = 7
        return build_state(model, optim, train), model

    hosts = [HostSlots.create(1, 4) for _ in range(2)]  # the survivor's agent, the new node's
    regions = [[Region(p) for p in slot_paths(h.describe(), 0)] for h in hosts]
    try:
        saved, model = state(trained=True)
        old = MemoryTier(regions[0][:2], Place(0, 2, _Net(1).wire(0), GEN), warn=print)
        old.save(7, saved)  # old rank 0's own snapshot; then its copy of old rank 1's, as received
        cap = snapshot.capture(saved)
        raw = encode_skeleton(snapshot.unpack(cap.skeleton))
        data = regions[0][2].begin(HEADER_SIZE + cap.data_len + max(len(raw), len(cap.skeleton)))  # write: the pickle too
        snapshot.write(cap, data, HEADER_SIZE, snapshot.Views())
        data[HEADER_SIZE + cap.data_len:HEADER_SIZE + cap.data_len + len(raw)].copy_(
            torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        regions[0][2].publish(Header(True, 7, 2, 1, cap.data_len, len(raw), cap.digest, generation=GEN))

        net, results, fresh = _Net(2), [None, None], [state(trained=False) for _ in range(2)]

        def restore(rank):
            tier = MemoryTier(regions[rank][:2], Place(rank, 2, net.wire(rank), GEN + 1), warn=print,
                              buddy_regions=regions[rank][2:], local_size=1)
            results[rank] = tier.restore(fresh[rank][0], Topology.build(2, 1, 2, "fsdp", rank=rank))

        threads = [threading.Thread(target=restore, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert all(r is not None and (r.source, r.step, r.receivers) == (BUDDY, 7, 2) for r in results), results
        for _, restored_model in fresh:
            assert all(torch.equal(a, b) for a, b in zip(restored_model.state_dict().values(),
                                                         model.state_dict().values(), strict=True))
    finally:
        for rs in regions:
            for r in rs:
                r.close()
        for h in hosts:
            h.close()


def test_copies_wait_within_the_budget():
    # A copy costing 6 ms of CPU against 100 ms steps at a 3 % budget: every 2nd step at most.
    assert buddy.hold(step=11, last_copy=10, copy_s=0.006, step_s=0.1, budget=0.03)
    assert not buddy.hold(step=12, last_copy=10, copy_s=0.006, step_s=0.1, budget=0.03)
    assert not buddy.hold(step=11, last_copy=10, copy_s=0.0, step_s=0.1, budget=0.03)  # not measured yet


def test_snapshots_not_sent_keep_the_last_copied_step_covered_after_a_node_loss():
    # Rank 0 of 2 nodes x 1 rank: snapshots every step, copies at steps 35 and 37 only (held
    # back by the budget in between), both settled. Its slots follow ``buddy.writable``.
    own_slots: list = [None, None]
    last = copied = None
    for step in range(34, 41):
        slot = buddy.writable(last, 2, {copied} - {None})
        own_slots[slot], last = step, slot
        if step in (35, 37):
            copied = slot  # settled before the next snapshot
    assert 37 in own_slots and 40 in own_slots
    offers = [[own(s, 2, 0) for s in own_slots] + [copy(35, 2, 1), copy(37, 2, 1)]]
    plan = choose(offers, world_size=1, replicated=False)
    assert (plan.source, plan.step) == (BUDDY, 37)
    # The old rule (the next slot, whatever it held) left steps 39 and 40: nothing covered.
    old = [own(39, 2, 0), own(40, 2, 0), copy(35, 2, 1), copy(37, 2, 1)]
    assert choose([old], world_size=1, replicated=False).source == STORAGE
