"""``elastic-harness ckpt``: ls, verify, export, import (then run), diff, on real runs.

``ckpt`` commands run in this process through the real CLI entry point (they need no
process group, and importing torch per call would triple the time); ``run`` runs as usual.
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from elastic_harness.cli import main
from tests.conftest import MLP, cli, final_ckpt, model_of

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


@pytest.fixture
def ckpt(capsys):
    def call(*args: str) -> SimpleNamespace:
        capsys.readouterr()
        code = main(["ckpt", *map(str, args)])
        out, err = capsys.readouterr()
        return SimpleNamespace(code=code, out=out, err=err)

    return call


def mlp_model():
    from elastic_harness.tasks.mlp import MLPRegression

    return MLPRegression(samples=1024, dim=16, hidden=64, depth=2).build_model()


def test_ls_shows_step_world_size_size_and_status(ckpt, mlp_reference):
    r = ckpt("ls", str(mlp_reference.run_dir))
    assert r.code == 0, r.err
    rows = [line.split() for line in r.out.splitlines()[2:]]
    assert [row[0] for row in rows] == ["40", "50", "60"] and all(row[1] == "2" for row in rows)
    assert all("verified" in line for line in r.out.splitlines()[2:])
    js = json.loads(ckpt("ls", str(mlp_reference.run_dir), "--json", "--verify", "full").out)
    assert [(x["step"], x["world_size"], x["verified"]) for x in js] == [(40, 2, True), (50, 2, True), (60, 2, True)]
    assert all(x["bytes"] > 10_000 for x in js)


def test_export_gives_a_plain_state_dict_with_clean_names(ckpt, mlp_reference, tmp_path):
    want = model_of(final_ckpt(mlp_reference.run_dir))
    for name in ("model.pt", "model.safetensors"):
        r = ckpt("export", str(mlp_reference.run_dir), "--to", str(tmp_path / name))
        assert r.code == 0, r.err
        assert "step-0000060" in r.out
    pt = torch.load(tmp_path / "model.pt", weights_only=True)  # single process, no group
    assert set(pt) == set(mlp_model().state_dict()) and not any(k.startswith("module.") for k in pt)
    mlp_model().load_state_dict(pt)  # strict: loads into the plain model
    st = pytest.importorskip("safetensors.torch").load_file(str(tmp_path / "model.safetensors"))
    for k, v in want.items():
        assert torch.equal(pt[k], v) and torch.equal(st[k], v)
    r = ckpt("export", str(mlp_reference.run_dir), "--step", "40", "--to", str(tmp_path / "m40.pt"))
    assert r.code == 0 and "step-0000040" in r.out


def test_import_legacy_file_then_run_resumes_from_it(ckpt, mlp_reference, tmp_path):
    weights = model_of(final_ckpt(mlp_reference.run_dir))
    legacy = tmp_path / "legacy.pt"  # rank 0's torch.save of a DDP model, as in the seeds
    torch.save({"model": {f"module.{k}": v for k, v in weights.items()},
                "optimizer": {"state": {}, "param_groups": [{"lr": 0.1}]}, "epoch": 3}, legacy)
    run_dir = tmp_path / "run"
    r = ckpt("import", str(legacy), str(MLP), "--run-dir", str(run_dir))
    assert r.code == 0, r.err
    diff = json.loads(ckpt("diff", str(run_dir), str(final_ckpt(mlp_reference.run_dir))).out)
    assert diff["comparable"] and diff["identical"] and diff["max_abs"] == 0.0
    again = ckpt("import", str(legacy), str(MLP), "--run-dir", str(run_dir))
    assert again.code == 2 and "already holds checkpoints" in again.err
    trained = cli("run", str(MLP), "--set", "train.steps=5", run_dir=run_dir)
    assert trained.code == 0, trained.err
    (resume,) = trained.kinds("resume")
    assert (resume["step"], resume["checkpoint"], resume["saved_world_size"]) == (0, "step-0000000", 1)
    first = trained.kinds("step")[0]["loss"]
    fresh_first = mlp_reference.kinds("step")[0]["loss"]
    assert first < 0.5 * fresh_first  # it trains on from the imported weights


def test_import_refuses_a_file_for_another_model(ckpt, tmp_path):
    bad = tmp_path / "bad.pt"
    torch.save({"module.0.weight": torch.zeros(3, 3)}, bad)
    r = ckpt("import", str(bad), str(MLP), "--run-dir", str(tmp_path / "run"))
    assert r.code == 2 and "does not fit" in r.err


def test_diff_of_two_steps(ckpt, mlp_reference):
    ck = mlp_reference.run_dir / "checkpoints"
    r = ckpt("diff", str(ck / "step-0000050"), str(ck / "step-0000060"))
    out = json.loads(r.out)
    assert r.code == 0 and out["comparable"] and not out["identical"]
    assert out["max_abs"] > 0 and out["max_rel"] > 0


def test_corrupt_checkpoints_are_set_aside_and_saved_again(ckpt, mlp_reference, tmp_path):
    """Issue 11 item 1: flip bytes in the newest shard, truncate the previous .metadata, run on:
    both are set aside, the saves over their steps happen, and keep=3 good ones remain."""
    run_dir = tmp_path / "run"
    shutil.copytree(mlp_reference.run_dir, run_dir)
    ck = run_dir / "checkpoints"
    shard = max((ck / "step-0000060").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[100:104] = bytes(b ^ 0x55 for b in data[100:104])
    shard.write_bytes(bytes(data))
    meta = ck / "step-0000050" / ".metadata"
    meta.write_bytes(meta.read_bytes()[:-7])
    v = ckpt("verify", str(run_dir))
    assert v.code == 1
    assert f"step-0000060: CORRUPT: {shard.name} checksum mismatch" in v.out
    assert "step-0000050: CORRUPT: .metadata has" in v.out and "a resume would load step-0000040" in v.out
    r = cli("run", str(MLP), "--set", "train.steps=70", run_dir=run_dir)
    assert r.code == 0, r.err
    assert r.kinds("resume")[-1]["step"] == 40
    quarantined = {q["name"]: q for q in r.kinds("quarantine")}
    assert set(quarantined) == {"step-0000060", "step-0000050"}
    assert "checksum mismatch" in quarantined["step-0000060"]["reason"]
    assert quarantined["step-0000050"]["reason"].startswith(".metadata has")
    assert [c["step"] for c in r.kinds("checkpoint")] == [50, 60, 70]  # saved over the bad steps
    assert r.kinds("skipped") == []
    after = ckpt("verify", str(run_dir))
    assert after.code == 0, after.out
    good = [line for line in after.out.splitlines() if "complete, verified (full)" in line]
    assert [line.split(":")[0] for line in good] == ["step-0000050", "step-0000060", "step-0000070"]
    assert after.out.count("set aside after failing") == 2  # kept for inspection, not counted
