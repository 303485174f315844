"""The parallel layout (``runtime.topology``): pure, validated when built."""

from __future__ import annotations

import pytest

from elastic_harness.errors import SpecError
from elastic_harness.launch.env import WorkerEnv
from elastic_harness.runtime.topology import DIMS, Topology

pytestmark = pytest.mark.timeout(30)

HSDP_TP = {"replicate": "auto", "shard": 2, "tensor": 2}


def test_ddp_replicates_over_the_whole_world_and_follows_the_nodes():
    t = Topology.build(8, 4, 2, "ddp", rank=5)
    assert t.shape == (8, 1, 1) and t.elastic == "replicate" and t.kind == "ddp"
    assert (t.dp_degree, t.dp_rank()) == (8, 5)
    assert t.group("replicate") == tuple(range(8)) and t.group("tensor") == (5,)
    assert (t.plane, t.coordinate(), t.ranks_per_share) == ((1, 1), 0, 1)  # every rank a whole replica


def test_fsdp_shards_over_the_whole_world_and_reshards_on_resize():
    t = Topology.build(6, 3, 2, "fsdp", rank=4)
    assert t.shape == (1, 6, 1) and t.elastic == "shard" and t.kind == "fsdp"
    assert (t.dp_degree, t.dp_rank()) == (6, 4)
    assert t.group("shard") == tuple(range(6)) and t.group("replicate") == (4,)
    assert (t.plane, t.coordinate()) == ((1, 1), 0)  # the shards resize: nothing stays put


def test_world_8_nproc_4_hsdp_with_tensor_parallelism():
    t = Topology.build(8, 4, 2, HSDP_TP)
    assert t.shape == (2, 2, 2) and t.elastic == "replicate" and t.kind == "mesh"
    assert t.groups("tensor") == ((0, 1), (2, 3), (4, 5), (6, 7))  # consecutive: within a node
    assert t.groups("shard") == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert t.groups("replicate") == ((0, 4), (1, 5), (2, 6), (3, 7))  # across the two nodes
    assert t.dp_degree == 4
    assert [t.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]  # a tensor group shares samples
    # the ranks averaging gradients with rank 0 (tensor coordinate 0) read the four shares
    assert [t.dp_rank(r) for r in range(8) if t.coords(r)[2] == 0] == [0, 1, 2, 3]
    assert t.ranks_per_share == 2
    # what stays as replicas come and go: the (shard, tensor) plane, the same coordinate on each node
    assert t.plane == (2, 2) and [t.coordinate(r) for r in range(8)] == [0, 1, 2, 3] * 2
    assert [t.coords(r) for r in (0, 3, 6)] == [(0, 0, 0), (0, 1, 1), (1, 1, 0)]
    for r in range(8):
        assert t.rank_at(*t.coords(r)) == r
        node = r // 4
        assert all(m // 4 == node for m in t.group("tensor", r) + t.group("shard", r))  # inner stays on a node


def test_every_rank_is_in_exactly_one_group_per_dimension():
    t = Topology.build(12, 6, 2, {"shard": 3, "tensor": 2})  # replicate defaults to auto
    assert t.shape == (2, 3, 2)
    for dim in DIMS:
        flat = sorted(r for g in t.groups(dim) for r in g)
        assert flat == list(range(12)) and all(len(g) == t.degree(dim) for g in t.groups(dim))


def test_replicate_auto_follows_the_node_count():
    assert Topology.build(4, 4, 1, HSDP_TP).replicate == 1
    assert Topology.build(12, 4, 3, HSDP_TP).replicate == 3


@pytest.mark.parametrize(("args", "words"), [
    ((8, 4, 2, {"shard": 3}), ["does not divide nproc_per_node 4", "divisors of 4"]),
    ((8, 4, 2, {"shard": 2, "tensor": 4}), ["= 8 does not divide nproc_per_node 4"]),
    ((8, 4, 2, {"replicate": 3, "shard": 2, "tensor": 2}), ["is 12, not the 8 processes", "auto"]),
    ((8, 4, 2, {"shards": 2}), ["'shards' is not a mesh dimension", "did you mean 'shard'"]),
    ((8, 4, 2, {"tensor": 0}), ["0 is not a degree"]),
    ((8, 4, 2, {"tensor": True}), ["True is not a degree"]),
    ((8, 4, 2, {"shard": "auto"}), ["only replicate may be auto"]),
    ((7, 4, 2, {"tensor": 2}), ["same processes on every node"]),
    ((8, 4, 2, "hsdp"), ["'hsdp' is not a layout"]),
])
def test_layouts_that_cannot_fit_are_refused_naming_parallelism(args, words):
    with pytest.raises(SpecError) as e:
        Topology.build(*args)
    assert e.value.path.startswith("parallelism")
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_impossible_numbers_are_our_bug_not_the_users():
    with pytest.raises(ValueError):
        Topology.build(0, 1, 1, "ddp")
    with pytest.raises(ValueError):
        Topology.build(2, 2, 1, "ddp", rank=2)
    with pytest.raises(ValueError):
        Topology.build(2, 2, 1, "ddp").group("pipeline")


def test_built_from_the_worker_environment_values():
    env = WorkerEnv.from_environ({"RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4",
                                  "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
    t = Topology.from_env(env, HSDP_TP)
    assert (t.rank, t.nodes, t.nproc_per_node, t.dp_rank()) == (6, 2, 4, 3)
    alone = Topology.from_env(WorkerEnv.from_environ({}, standalone_ok=True), "ddp")
    assert (alone.world_size, alone.nodes, alone.dp_degree, alone.dp_rank()) == (1, 1, 1, 0)
    # plain torchrun without GROUP_WORLD_SIZE: nodes from the local world size
    older = WorkerEnv.from_environ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
    assert Topology.from_env(older, "fsdp").nodes == 2


def test_the_data_split_and_the_sample_records_follow_the_data_parallel_ranks(tmp_path):
    """A step's global batch is shared over the data-parallel ranks: each sample once among
    them, and the ranks of one tensor group read the same share (and record it as such)."""
    import json

    from elastic_harness.data.sampler import EpochOrder
    from elastic_harness.runtime.audit import Writer, record_samples
    from elastic_harness.runtime.loader import planner

    t = Topology.build(8, 4, 2, {"replicate": "auto", "shard": 1, "tensor": 2})
    order, g = EpochOrder(0, 40), 12
    plans = {r: planner(order, 0, 0, g, t.dp_degree, t.dp_rank(r), 2)(0) for r in range(t.world_size)}
    for group in t.groups("tensor"):
        assert len({json.dumps(plans[r]) for r in group}) == 1
    shares = [p for r in range(t.world_size) if t.coords(r)[2] == 0 for chunk in plans[r] for p, _ in chunk]
    assert sorted(shares) == list(range(g))
    record_samples(tmp_path / "r.jsonl", Writer("gen", 3, t.world_size, t.dp_rank(3), t.dp_degree), 1,
                   plans[3], None)
    line = json.loads((tmp_path / "r.jsonl").read_text())
    assert (line["rank"], line["world_size"], line["dp_rank"], line["dp_size"]) == (3, 8, 1, 4)
