"""A mesh layout's replicas restore from survivors' memory when only the replicate degree
changed (issue 26 item 1 under HSDP): which coordinate's snapshot each rank takes, from whom,
and when storage is used instead (``memtier.choose``); what carries the mesh (headers,
offers); the layout check that lets an HSDP shard load across replicate degrees
(``snapshot``); and one restore over real gloo ranks with FSDP2 DTensors (``MemoryTier``).
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from elastic_harness.memtier import buddy, snapshot
from elastic_harness.memtier.choose import MEMORY, PEER, STORAGE, Offer, choose, offers_of
from elastic_harness.memtier.peer import decode_offers, encode_offers, portable, restore_rules
from elastic_harness.memtier.slots import Header
from elastic_harness.runtime.topology import Topology
from tests.servers import spawn_ranks

pytestmark = pytest.mark.timeout(60)

D, E = b"d" * 32, b"e" * 32
GEN, NEXT_GEN = 0xABC, 0xDEF
HSDP = (2, 1)  # shard 2, tensor 1: one replica per node of 2 processes


def layout(world, mesh=HSDP, rank=0):
    """A mesh job's layout: ``mesh`` (shard, tensor) within each node of ``shard x tensor`` ranks."""
    n = mesh[0] * mesh[1]
    return Topology.build(world, n, world // n, {"shard": mesh[0], "tensor": mesh[1]}, rank=rank)


def snap(step, world, rank, gen=GEN, digest=D, mesh=HSDP):
    return Offer(step, world, rank, digest, False, gen, mesh=mesh, coordinate=layout(world, mesh).coordinate(rank))


def plan_of(offers, world, mesh=HSDP):
    rules = restore_rules(layout(world, mesh), world)
    return choose(offers, world_size=world, replicated=False, sharded=False, mesh=rules.mesh,
                  coordinates=rules.coordinates)


# ----- the decision ---------------------------------------------------------------------------

def test_a_lost_node_leaves_every_survivor_its_own_coordinate_memory():
    # 2 nodes x 2 (replicate 2, shard 2) snapshotted step 10; node 0 is lost, node 1's ranks
    # (old 2 and 3: coordinates 0 and 1) are ranks 0 and 1 now.
    plan = plan_of([[snap(10, 4, 2), snap(9, 4, 2)], [snap(10, 4, 3), snap(9, 4, 3)]], 2)
    assert (plan.source, plan.step, plan.holders, plan.senders(2)) == (MEMORY, 10, (0, 1), {})
    assert (plan.saved_world_size, plan.generation, plan.mesh, plan.digests) == (4, GEN, HSDP, (D, D))


def test_a_joining_node_receives_each_coordinate_from_a_replica_holding_it():
    # 1 replica at world size 2 wrote step 20; a node joins. It may get ranks 2, 3 or 0, 1.
    plan = plan_of([[snap(20, 2, 0)], [snap(20, 2, 1)], [], []], 4)
    assert (plan.source, plan.step, plan.holders, plan.senders(4)) == (PEER, 20, (0, 1), {2: 0, 3: 1})
    plan = plan_of([[], [], [snap(20, 2, 0)], [snap(20, 2, 1)]], 4)
    assert (plan.source, plan.senders(4)) == (PEER, {0: 2, 1: 3})
    # 2 replicas survive, 2 nodes join: each coordinate's receivers spread over its holders.
    offers = [[snap(20, 4, r)] for r in range(4)] + [[] for _ in range(4)]
    assert plan_of(offers, 8).senders(8) == {4: 0, 5: 1, 6: 2, 7: 3}
    # with a tensor degree too: coordinates are rank % (shard * tensor)
    tp = (1, 2)
    plan = plan_of([[snap(5, 2, 0, mesh=tp)], [snap(5, 2, 1, mesh=tp)], [], []], 4, mesh=tp)
    assert (plan.source, plan.senders(4)) == (PEER, {2: 0, 3: 1})


def test_an_uncovered_coordinate_takes_the_newest_covered_step_or_storage_with_the_reason():
    # Coordinate 1's only holder of step 12 is gone; step 11 is covered: that one.
    offers = [[snap(12, 4, 0), snap(11, 4, 0)], [snap(11, 4, 1)]]
    assert (plan_of(offers, 2).source, plan_of(offers, 2).step) == (MEMORY, 11)
    plan = plan_of([[snap(12, 4, 0)], []], 2)
    assert plan.source == STORAGE
    assert "coordinate(s) 1" in plan.reason and "step-12" in plan.reason
    # A snapshot is only taken from a holder of its own coordinate (a node's local rank l
    # always has coordinate l % (shard x tensor)).
    assert plan_of([[snap(12, 4, 1)], [snap(12, 4, 0)]], 2).source == STORAGE


def test_steps_generations_world_sizes_and_layouts_are_never_mixed():
    # Coordinate 0 of one generation, coordinate 1 of another: neither covers the step.
    gens = [[snap(12, 4, 0)], [snap(12, 4, 1, gen=NEXT_GEN)]]
    assert plan_of(gens, 2).source == STORAGE
    worlds = [[snap(12, 4, 0)], [snap(12, 6, 1)]]  # written at two old world sizes
    assert plan_of(worlds, 2).source == STORAGE
    steps = [[snap(12, 4, 0)], [snap(11, 4, 1)]]
    assert plan_of(steps, 2).source == STORAGE
    # Two replicas of coordinate 0 that disagree on its layout rule step 12 out (3 replicas
    # at world size 6, node 1 lost: survivors hold old ranks 0, 1 and 4, 5).
    clash = [[snap(12, 6, 0), snap(11, 6, 0)], [snap(12, 6, 1), snap(11, 6, 1)],
             [snap(12, 6, 4, digest=E), snap(11, 6, 4)], [snap(12, 6, 5), snap(11, 6, 5)]]
    assert (plan_of(clash, 4).source, plan_of(clash, 4).step) == (MEMORY, 11)
    no_gen = [[snap(12, 4, 0, gen=0)], [snap(12, 4, 1, gen=0)]]  # generation unknown
    assert plan_of(no_gen, 2).source == STORAGE


def test_a_changed_shard_or_tensor_degree_goes_to_storage_for_dcp_to_reshard():
    written = [[snap(12, 4, 0)], [snap(12, 4, 1)], [snap(12, 4, 2)], [snap(12, 4, 3)]]
    plan = plan_of(written + [[], [], [], []], 8, mesh=(4, 1))  # a node joins as shard 2 -> 4
    assert plan.source == STORAGE and "degrees (4, 1)" in plan.reason
    assert plan_of(written[:2], 2, mesh=(1, 2)).source == STORAGE  # shard 2 -> tensor 2
    # Without a mesh (ddp, fsdp) nothing changes: mesh snapshots are no replicas of theirs.
    assert choose(written[:2], world_size=2, replicated=False, sharded=False).source == STORAGE
    # An unchanged world size still restores from each rank's own snapshot (a worker crash).
    same = plan_of(written, 4)
    assert (same.source, same.step, same.same_layout) == (MEMORY, 12, True)


def test_a_storage_checkpoint_newer_than_the_covered_step_wins():
    assert "mesh" in buddy.older_than_storage(11, 12, "mesh replicas' snapshots")
    assert buddy.older_than_storage(12, 12, "mesh replicas' snapshots") is None


# ----- what carries the mesh ------------------------------------------------------------------

def test_headers_and_offers_carry_the_writers_mesh_degrees():
    h = Header(True, 12, 4, 3, 100, 10, D, generation=GEN, mesh=(2, 1), coordinate=1)
    back = Header.unpack(h.pack())
    assert back == h
    (o,) = offers_of([back])
    assert (o.mesh, o.coordinate, o.generation) == ((2, 1), 1, GEN)
    assert decode_offers(encode_offers([o])) == [o]
    hsdp = layout(4)
    assert restore_rules(hsdp, 4, portable(hsdp, None, ["model", "optim", "train"])).mesh == (2, 1)
    assert restore_rules(hsdp, 4, portable(hsdp, None, ["model", "extra.rng"])).mesh is None  # per-rank entries: no
    assert restore_rules(Topology.build(4, 2, 2, "fsdp"), 4).mesh is None


def test_an_hsdp_shard_fits_its_1d_twin_and_nothing_else():
    """The replicate dimension's ``Replicate`` placement says how many replicas exist, not
    which bytes a rank holds: the layout digest and ``misfit`` set it aside, nothing else."""
    def digest(placements):
        return snapshot._digest(((torch.float32, (3,), ("dtensor", (6,), placements)),))

    assert digest((Replicate(), Shard(0))) == digest((Shard(0),))
    assert digest((Shard(0),)) != digest((Shard(1),)) and digest((Shard(0),)) != digest((Shard(0), Shard(0)))
    assert snapshot._split(("dtensor", (6,), (Replicate(), Shard(0)))) == ("dtensor", (6,), (Shard(0),))
    assert snapshot._split(("tensor",)) == ("tensor",)
    plain = ((torch.float32, (3,), ("tensor",)),)
    assert snapshot._digest(plain) == snapshot._digest(plain)  # plain state: as before
    saved = snapshot.TensorRef(0, 12, torch.float32, (3,), ("dtensor", (6,), (Replicate(), Shard(0))))
    assert "saved" in snapshot.misfit(saved, torch.zeros(3))  # a shard saved, a plain tensor here


def test_a_survivors_snapshot_restores_unless_storage_holds_a_newer_step(tmp_path):
    """One rank left of two replicas (shard 1): its own slot holds step 3, written at world
    size 2; it restores from it (memory), but not when storage holds step 5 (storage)."""
    from elastic_harness.memtier.host import HostSlots, slot_paths
    from elastic_harness.memtier.peer import Wire
    from elastic_harness.memtier.region import Region
    from elastic_harness.memtier.tier import MemoryTier, Place
    from tests.memtier.test_memtier_peer import _state

    host = HostSlots.create(1)
    regions = [Region(p) for p in slot_paths(host.describe(), 0)]
    try:
        wire = Wire(lambda values: [values], lambda t, dst: None, lambda t, src: None)
        state, model, _ = _state()
        saver = MemoryTier(regions, Place(1, 2, wire, GEN), warn=print)
        saver.rules = restore_rules(layout(2, (1, 1), rank=1), 2)
        assert saver.save(3, state)
        warned: list[str] = []
        fresh, fresh_model, _ = _state(steps=0)
        tier = MemoryTier(regions, Place(0, 1, wire, NEXT_GEN), warn=warned.append)
        assert tier.restore(fresh, layout(1, (1, 1)), durable=lambda: 5) is None
        assert "older than the checkpoint of step 5" in warned[0] and fresh["train"].step == 0
        assert saver.save(3, state)  # the fallback unpublished the slots: write it again
        got = tier.restore(fresh, layout(1, (1, 1)), durable=lambda: 3)
        assert (got.source, got.step, got.saved_world_size, got.senders) == (MEMORY, 3, 2, ())
        assert fresh["train"].step == 3
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True))
    finally:
        for r in regions:
            r.close()
        host.close()


# ----- a restore over real gloo ranks -----------------------------------------------------------

def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))


def _hsdp_rank(rank: int, port: int, root: str) -> None:
    """One rank of a phase (``root/phase.json``: world size, replicate degree, this host's
    slots per rank): build FSDP2 on a (replicate, shard 1) mesh, restore from the memory tier,
    write what it restored; the writing phase trains 3 steps and snapshots them first."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from elastic_harness.data.sampler import DataState
    from elastic_harness.memtier.peer import Wire
    from elastic_harness.memtier.tier import MemoryTier, Place
    from elastic_harness.runtime.state import TrainState, build_state

    phase = json.loads(Path(root, "phase.json").read_text())
    world, replicate = phase["world"], phase["replicate"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=dt.timedelta(seconds=60))
    out: dict = {}
    try:
        group = dist.new_group(backend="gloo")
        mesh = init_device_mesh("cpu", (replicate, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
        model = _model()
        fully_shard(model, mesh=mesh if replicate > 1 else mesh["dp_shard"])
        optim = torch.optim.AdamW(model.parameters(), lr=0.01)
        train = TrainState(DataState(0, 64), world_size=world)
        state = build_state(model, optim, train)
        tier = MemoryTier.open(phase["slots"][rank], 0,
                               Place(rank, world, Wire.of(group, world), phase["generation"]), warn=print)
        got = tier.restore(state, layout(world, (1, 1), rank=rank))
        out["restored"] = None if got is None else [got.source, got.step, got.saved_world_size]
        out["tensors"] = _leaves(model, optim)
        for i in range(phase["train"]):
            model(torch.full((2, 4), float(i + train.step))).sum().backward()
            optim.step()
            optim.zero_grad()
            train.step += 1
        if phase["train"]:
            assert tier.save(train.step, state)
        out["after"] = _leaves(model, optim)
        out["placements"] = [str(p.placements) for p in model.parameters()]
        tier.close()
    finally:
        dist.destroy_process_group()
    Path(root, f"rank{rank}.json").write_text(json.dumps(out))


def _leaves(model, optim) -> list:
    """Every tensor a restore brings back (parameter shards, optimizer states), as lists."""
    out = [p.detach() for p in model.parameters()]
    for p in model.parameters():
        out += [v for _, v in sorted(optim.state[p].items())]
    return [(t.to_local() if hasattr(t, "to_local") else t).tolist() for t in out]


@pytest.mark.e2e  # forked gloo ranks under FSDP2, three phases: a few seconds
@pytest.mark.timeout(180)
def test_hsdp_replicas_restore_from_a_surviving_replica_bit_for_bit(tmp_path):
    """Replicate 2 (one rank per "node", shard 1) writes step 3; node 1 is lost: the survivor
    restores from its own slot (memory) onto a 1-D mesh, trains, writes step 4; a fresh node
    joins: it receives that snapshot over gloo (peer), 1-D placements into a 2-D mesh, and
    every rank holds exactly the tensors written."""
    from elastic_harness.memtier.host import HostSlots

    hosts = [HostSlots.create(1) for _ in range(2)]
    try:
        def phase(world, replicate, generation, train=0):
            Path(tmp_path, "phase.json").write_text(json.dumps(
                {"world": world, "replicate": replicate, "slots": [h.describe() for h in hosts[:world]],
                 "generation": generation, "train": train}))
            return spawn_ranks(_hsdp_rank, tmp_path, nprocs=world)

        written = phase(2, 2, 1, train=3)
        assert [w["restored"] for w in written] == [None, None]
        assert written[0]["after"] == written[1]["after"]  # replicas: the same state
        assert "Replicate(), Shard(dim=0)" in written[0]["placements"][0]
        hosts[1].close()  # node 1 lost, its slots with it
        (shrunk,) = phase(1, 1, 2, train=1)
        assert shrunk["restored"] == [MEMORY, 3, 2]
        assert shrunk["tensors"] == written[0]["after"] and "Replicate" not in shrunk["placements"][0]
        hosts[1] = HostSlots.create(1)  # a new node joins, with empty slots
        grown = phase(2, 2, 3)
        assert [g["restored"] for g in grown] == [[PEER, 4, 1]] * 2
        assert grown[0]["tensors"] == grown[1]["tensors"] == shrunk["after"]
    finally:
        for h in hosts:
            h.close()
