"""The job's ``parallelism`` (spec.layout): ddp, fsdp or a mesh, refused when it cannot fit."""

from __future__ import annotations

import pytest

from elastic_harness.errors import SpecError
from elastic_harness.spec import layout, parse_job

BASE = """
name: j
task: {target: "elastic_harness.tasks.mlp:MLPRegression"}
nproc_per_node: 4
nodes: {min: 1, max: 3}
train: {global_batch_size: 12}
"""


def job(extra: str, *overrides: str):
    return parse_job(BASE + extra, list(overrides))


def test_a_mesh_is_normalized_with_every_dimension_and_round_trips():
    from elastic_harness.spec import dump_job

    spec = job("parallelism: {shard: 2, tensor: 2}")
    assert spec.parallelism == {"replicate": "auto", "shard": 2, "tensor": 2}
    assert parse_job(dump_job(spec)) == spec
    assert job("parallelism: fsdp").parallelism == "fsdp"


def test_overrides_set_mesh_dimensions():
    spec = job("parallelism: {tensor: 2}", "parallelism.shard=2")
    assert spec.parallelism["shard"] == 2


@pytest.mark.parametrize(("extra", "words"), [
    ("parallelism: {shard: 3}", ["does not divide nproc_per_node 4"]),
    ("parallelism: {shard: 2, tensor: 4}", ["= 8 does not divide"]),
    ("parallelism: {replicate: 2, shard: 4}", ["2 problems", "not the 4 processes", "not the 12 processes"]),
    ("parallelism: {tensr: 2, shard: 0}", ["2 problems", "did you mean 'tensor'", "0 is not a degree"]),
    ("parallelism: hsdp", ["'hsdp' is not a layout"]),
    ("parallelism: [2, 2]", ["is not a layout"]),
])
def test_layouts_that_cannot_fit_are_refused_all_at_once(extra, words):
    with pytest.raises(SpecError) as e:
        job(extra)
    assert e.value.path.startswith("parallelism")
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_the_global_batch_is_checked_against_data_parallel_ranks_not_processes():
    # 3 nodes x 4 processes, tensor 2: 6 data-parallel ranks, so 6 samples are enough
    assert job("parallelism: {tensor: 2}", "train.global_batch_size=6").train.global_batch_size == 6
    with pytest.raises(SpecError, match="data-parallel degree"):
        job("parallelism: ddp", "train.global_batch_size=6")


def test_describe_names_the_mesh_at_the_fewest_and_most_nodes():
    line = layout.describe({"replicate": "auto", "shard": 2, "tensor": 2}, 1, 3, 4)
    assert "replicate 1 x shard 2 x tensor 2 .. replicate 3 x shard 2 x tensor 2" in line
    assert "data-parallel degree 2 .. 6" in line
