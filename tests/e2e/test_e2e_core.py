"""End to end through the real elastic agent: crashes, resizes, checkpoint selection.

The reference is the uninterrupted MLP run at world size 2 (``mlp_reference``). The MLP job
has 1024 samples, a global batch of 30 (so shares are uneven at 4 ranks and steps straddle
epochs) and 60 steps (almost two epochs).
"""

from __future__ import annotations

import shutil

import pytest

from elastic_harness.checkpoint.offline import compare
from elastic_harness.commands.report import DEFAULT_ATOL as ATOL
from elastic_harness.commands.report import DEFAULT_RTOL as RTOL
from tests.audit import audit
from tests.conftest import MLP, cli, final_ckpt, model_of

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

N, G, STEPS = 1024, 30, 60
# Across resizes, reduction order changes; measured max |diff| ~1e-7 on this job. The
# tolerance is `verify`'s, a claim about short spans (docs/tolerance.md).


def assert_close(a: dict, b: dict) -> dict:
    diff = compare(a, b)
    assert diff["comparable"], diff
    for k in a:
        assert (a[k].double() - b[k].double()).abs().le(ATOL + RTOL * b[k].double().abs()).all(), (k, diff)
    return diff


def test_reference_run_uses_each_sample_once(mlp_reference):
    s = mlp_reference.summary
    assert s["finished"] and s["steps"] == STEPS and s["samples_consumed"] == STEPS * G
    assert s["final_loss"] < s["first_loss"] * 0.5
    audit(mlp_reference.run_dir, N, G, STEPS)
    assert [e["step"] for e in mlp_reference.kinds("checkpoint")] == [10, 20, 30, 40, 50, 60]


def test_killed_worker_resumes_bit_identical(mlp_reference, tmp_path):
    """Cold: fresh interpreters and storage only (the in-memory tier has its own tests)."""
    r = cli("run", str(MLP), "--chaos", "kill-worker:1@25", "--set", "train.record_samples=true",
            "--set", "warm_start=false", "--set", "checkpoint.memory_every=0", run_dir=tmp_path)
    assert r.code == 0, r.err
    (fault,) = r.kinds("fault")
    assert (fault["kind"], fault["rank"], fault["step"]) == ("kill-worker", 1, 25)
    fresh, resumed = r.kinds("resume")
    # Step 20's async save may still be committing when rank 1 dies 5 steps later; then the
    # resume falls back to step 10. Either way the result must be the same, bit for bit.
    assert fresh["fresh"] and resumed["step"] in (10, 20) and resumed["saved_world_size"] == 2
    assert r.summary["restarts"] == 1
    assert r.summary["model_digest"] == mlp_reference.summary["model_digest"]
    diff = compare(model_of(final_ckpt(tmp_path)), model_of(final_ckpt(mlp_reference.run_dir)))
    assert diff["identical"], diff
    audit(tmp_path, N, G, STEPS)


@pytest.mark.parametrize("first, second, parallelism", [
    pytest.param(2, 3, "ddp", marks=pytest.mark.compat), (3, 1, "ddp"), (2, 4, "fsdp")])
def test_resume_at_another_world_size(mlp_reference, tmp_path, first, second, parallelism):
    common = ["--set", "train.record_samples=true", "--set", f"parallelism={parallelism}"]
    stopped = cli("run", str(MLP), "--nproc-per-node", str(first), "--chaos", "preempt:0@25",
                  *common, run_dir=tmp_path)
    assert stopped.code == 143, stopped.err
    assert "drained and saved at step" in stopped.err
    (drain,) = stopped.kinds("drain")
    assert drain["step"] >= 25 and drain["world_size"] == first
    resumed = cli("run", str(MLP), "--nproc-per-node", str(second), *common, run_dir=tmp_path)
    assert resumed.code == 0, resumed.err
    (resume,) = resumed.kinds("resume")
    assert resume["step"] == drain["step"], "graceful stop must lose no step"
    assert (resume["saved_world_size"], resume["world_size"]) == (first, second)
    seen = audit(tmp_path, N, G, STEPS)
    assert seen["world_sizes"][1] == first and seen["world_sizes"][STEPS] == second
    diff = assert_close(model_of(final_ckpt(tmp_path)), model_of(final_ckpt(mlp_reference.run_dir)))
    print(f"{first}->{second} {parallelism}: max_abs={diff['max_abs']:.3g} max_rel={diff['max_rel']:.3g}")


def test_step_dir_without_metadata_is_ignored(tmp_path):
    first = cli("run", str(MLP), "--set", "train.steps=20", run_dir=tmp_path)
    assert first.code == 0, first.err
    ckpts = tmp_path / "checkpoints"
    partial = ckpts / "step-0000025"
    shutil.copytree(ckpts / "step-0000020", partial)
    (partial / ".metadata").unlink()
    (partial / "manifest.json").unlink()
    again = cli("run", str(MLP), "--set", "train.steps=30", run_dir=tmp_path)
    assert again.code == 0, again.err
    (resume,) = again.kinds("resume")
    assert resume["step"] == 20
    assert any("ignoring incomplete checkpoint step-0000025" in w["message"] for w in again.kinds("warning"))


def test_rerun_of_finished_job_changes_nothing(tmp_path):
    first = cli("run", str(MLP), "--set", "train.steps=10", run_dir=tmp_path)
    assert first.code == 0, first.err
    before = {p: p.read_bytes() for p in sorted((tmp_path / "checkpoints").rglob("*")) if p.is_file()}
    log = (tmp_path / "events.jsonl").read_bytes()
    again = cli("run", str(MLP), "--set", "train.steps=10", run_dir=tmp_path)
    assert again.code == 0, again.err
    assert "already finished" in again.out + again.err  # said, not a silent no-op
    assert again.summary["model_digest"] == first.summary["model_digest"]
    after = {p: p.read_bytes() for p in sorted((tmp_path / "checkpoints").rglob("*")) if p.is_file()}
    assert after == before and (tmp_path / "events.jsonl").read_bytes() == log, "nothing started, nothing written"
