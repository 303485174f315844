"""End to end: worker crashes restored from the agents' memory, and what falls back to storage.

The reference is the uninterrupted MLP run at world size 2 (``mlp_reference``).
"""

from __future__ import annotations

import pytest

from elastic_harness.checkpoint.offline import compare
from tests.audit import audit
from tests.conftest import MLP, cli, final_ckpt, model_of
from tests.test_e2e_core import STEPS, G, N, assert_close

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]


def test_worker_crashes_restore_from_memory_bit_identical(mlp_reference, tmp_path):
    faults = ["kill-worker:1@25", "kill-worker:0@33", "kill-worker:1@47"]
    r = cli("run", str(MLP), *[a for f in faults for a in ("--chaos", f)],
            "--set", "train.record_samples=true", run_dir=tmp_path)
    assert r.code == 0, r.err
    assert [f["step"] for f in r.kinds("fault")] == [25, 33, 47]
    fresh, *resumed = r.kinds("resume")
    assert fresh["fresh"]
    # Every crash restores from memory, no checkpoint read, at most K - 1 steps before the
    # crash: the ranks snapshot at the same steps while K follows the measured costs.
    k = max(e["every"] for e in r.kinds("memory"))
    assert [e["source"] for e in resumed] == ["memory"] * 3
    assert all(crash - k < e["step"] <= crash for e, crash in zip(resumed, (25, 33, 47), strict=True))
    assert all("checkpoint" not in e for e in resumed)
    assert f"restored from memory at step {resumed[0]['step']}" in r.out + r.err
    assert r.summary["restarts"] == 3
    assert r.summary["model_digest"] == mlp_reference.summary["model_digest"]
    diff = compare(model_of(final_ckpt(tmp_path)), model_of(final_ckpt(mlp_reference.run_dir)))
    assert diff["identical"], diff
    audit(tmp_path, N, G, STEPS)


def test_a_lost_node_falls_back_to_storage(mlp_reference, tmp_path):
    """A crash on a two-node run restores from both agents' memory; then a node is lost, the
    survivor's memory is of world size 2, and the group of 1 loads the DCP checkpoint."""
    r = cli("run", str(MLP), "--nodes", "2", "--set", "nodes.min=1", "--set", "nodes.max=2",
            "--nproc-per-node", "1", "--set", "train.record_samples=true",
            "--chaos", "kill-worker:1@15", "--chaos", "kill-node:1@35", run_dir=tmp_path)
    assert r.code == 0, r.err
    assert [f["kind"] for f in r.kinds("fault")] == ["kill-worker", "kill-node"]
    after_crash, after_loss = r.kinds("resume")[-2:]
    k = max(e["every"] for e in r.kinds("memory"))
    assert (after_crash["source"], after_crash["world_size"]) == ("memory", 2)
    assert 15 - k < after_crash["step"] <= 15
    assert after_loss["source"] == "storage" and after_loss["step"] in (20, 30)
    assert (after_loss["saved_world_size"], after_loss["world_size"]) == (2, 1)
    seen = audit(tmp_path, N, G, STEPS)
    assert seen["world_sizes"][STEPS] == 1
    assert_close(model_of(final_ckpt(tmp_path)), model_of(final_ckpt(mlp_reference.run_dir)))
