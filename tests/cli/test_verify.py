"""``run --verify REF`` and ``submit --verify REF``: the reference is read before anything
starts, and a final model that is not the reference's is the run's recorded failure, so a
submission's ``status`` says ``failed`` (a CI job that submits does not pass)."""

from __future__ import annotations

import json

import pytest

from tests.cli.test_bad_args import assert_one_line_error
from tests.conftest import MLP, cli


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", ["run", "submit"])
def test_a_reference_that_cannot_be_read_is_refused_before_anything_starts(cli_here, tmp_path, command):
    empty = tmp_path / "empty"
    empty.mkdir()
    for ref, words in ((tmp_path / "missing", "is not a directory"), (empty, "no complete checkpoint")):
        r = cli_here(command, MLP, "--run-dir", tmp_path / "run", "--verify", ref)
        assert_one_line_error(r, f"--verify {ref}: ", words)
    assert not (tmp_path / "run").exists(), "nothing was started"


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_model_that_is_not_the_references_fails_the_run_and_its_status(mlp_reference, tmp_path):
    """Another seed trains another model: `run --verify` exits 1 and records exit 1, and the
    status of its run dir (what `submit` shows: its supervisor is this `run`) says failed."""
    run_dir = tmp_path / "other"
    r = cli("run", str(MLP), "--set", "train.steps=3", "--set", "train.seed=1", "--verify",
            str(mlp_reference.run_dir), run_dir=run_dir)
    assert r.code == 1, r.err
    assert "OUTSIDE atol" in r.out and "error: --verify: the final model is not" in r.err
    assert [e["code"] for e in r.kinds("exit") if e["who"] == "host"] == [1]
    st = json.loads(cli("status", str(run_dir), "--json").out)
    assert (st["state"], st["exit_code"]) == ("failed", 1), st
    assert "--verify: the final model is not" in st["reason"]
