"""End to end: worker crashes restored from the agents' memory, and what falls back to storage.

The reference is the uninterrupted MLP run at world size 2 (``mlp_reference``).
"""

from __future__ import annotations

import pytest

from elastic_harness.checkpoint.offline import compare
from tests.audit import audit
from tests.conftest import MLP, cli, final_ckpt, model_of, read_jsonl
from tests.e2e.test_e2e_core import STEPS, G, N
from tests.lanes import DETECTION

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420), DETECTION]


@pytest.mark.compat  # .ci/compat's end-to-end set (docs/torch-versions.md)
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
    # The surviving rank keeps the step it completed (checkpoint.memory_on_failure) and the
    # restarted one receives it (peer), else both read their last snapshot (memory).
    k = max(e["every"] for e in r.kinds("memory"))
    assert {e["source"] for e in resumed} <= {"memory", "peer"}
    assert all(crash - k < e["step"] <= crash for e, crash in zip(resumed, (25, 33, 47), strict=True))
    assert all("checkpoint" not in e for e in resumed)
    assert f"restored from {resumed[0]['source']} at step {resumed[0]['step']}" in r.out + r.err
    assert r.summary["restarts"] == 3
    assert r.summary["model_digest"] == mlp_reference.summary["model_digest"]
    diff = compare(model_of(final_ckpt(tmp_path)), model_of(final_ckpt(mlp_reference.run_dir)))
    assert diff["identical"], diff
    audit(tmp_path, N, G, STEPS)


def test_the_survivor_of_a_worker_crash_keeps_the_step_it_completed(mlp_reference, tmp_path):
    """checkpoint.memory_on_failure: with the periodic snapshots spread out (memory_every
    1000: only the durable saves' forced ones, every 10 steps), a crash after step 25 still
    redoes no step: the surviving rank kept step 25 in its agent's memory on its way down and
    the restarted rank received it from there. The run ends bit-identical to the
    uninterrupted one, every sample trained exactly once. (A budget that arming after every
    step fits in on any machine: at 3 % this toy's arming, ~0.1 ms, may cost more than the
    2 % arming is allowed of its ~4 ms steps, and then it does not arm.)"""
    r = cli("run", str(MLP), "--chaos", "kill-worker:1@25", "--set", "checkpoint.memory_every=1000",
            "--set", "checkpoint.memory_budget=0.5", "--set", "train.record_samples=true", run_dir=tmp_path)
    assert r.code == 0, r.err
    (rec,) = r.kinds("recovery")  # in place: rank 0 kept step 25 in its tier on its way to park
    assert rec["mode"] == "rerun" and len(rec["kept"]) == 1
    resumed = r.kinds("resume")[-1]
    assert (resumed["source"], resumed["step"], resumed["senders"], resumed["receivers"]) == ("peer", 25, [0], 1)
    assert r.summary["model_digest"] == mlp_reference.summary["model_digest"]
    audit(tmp_path, N, G, STEPS)


LOST_NODE = ["--nodes", "2", "--set", "nodes.min=1", "--set", "nodes.max=2", "--nproc-per-node", "1",
             "--set", "train.record_samples=true", "--chaos", "kill-worker:1@15", "--chaos", "kill-node:1@35"]


def test_a_lost_node_restores_from_the_survivors_memory_like_storage(tmp_path):
    """DDP: a crash on a two-node run restores from both agents' memory; then a node is lost
    and the survivor restores its own snapshot, written at world size 2, at world size 1: no
    storage read, at most one step redone. The same run restored from storage at the same
    step ends bit-identical: the tiers are interchangeable. (The warm restart, asked for: in
    place the survivor would finish the step in flight instead of restoring,
    tests/e2e/test_in_flight.py.)"""
    r = cli("run", str(MLP), *LOST_NODE, "--set", "checkpoint.memory_budget=0", "--set", "recovery=restart",
            run_dir=tmp_path / "memory")
    assert r.code == 0, r.err
    assert [f["kind"] for f in r.kinds("fault")] == ["kill-worker", "kill-node"]
    after_crash, after_loss = r.kinds("resume")[-2:]
    assert (after_crash["source"], after_crash["step"], after_crash["world_size"]) == ("memory", 15, 2)
    step = after_loss["step"]  # the survivor may finish a few steps after 35 before it notices
    assert after_loss["source"] == "memory" and step >= 35
    assert (after_loss["saved_world_size"], after_loss["world_size"]) == (2, 1)
    assert "checkpoint" not in after_loss and after_loss["receivers"] == 0
    done_at_2 = max(s["step"] for s in read_jsonl(tmp_path / "memory" / "samples" / "rank-0.jsonl")
                    if s["world_size"] == 2)
    assert done_at_2 - step <= 1  # steps redone: every step is snapshotted (memory_budget 0)
    seen = audit(tmp_path / "memory", N, G, STEPS)
    assert seen["world_sizes"][STEPS] == 1
    # The twin: world size 2 up to that step, saved to storage (no memory tier), then resumed
    # from storage at world size 1. The learning rate is constant: train.steps changes nothing else.
    assert_storage_twin_matches(r, tmp_path / "storage", step)


def assert_storage_twin_matches(r, twin, step: int, layout: tuple[str, ...] = ()) -> None:
    """The same job at world size 2 up to ``step`` saved to storage (no memory tier), then
    resumed from storage at world size 1, ends with ``r``'s model digest."""
    off = [*layout, "--set", "checkpoint.memory_every=0"]
    first = cli("run", str(MLP), *off, "--set", f"train.steps={step}", run_dir=twin)
    assert first.code == 0, first.err
    second = cli("run", str(MLP), *off, "--nproc-per-node", "1", run_dir=twin)
    assert second.code == 0, second.err
    resumed = second.kinds("resume")[-1]
    assert (resumed["source"], resumed["step"], resumed["world_size"]) == ("storage", step, 1)
    assert r.summary["model_digest"] == second.summary["model_digest"]
