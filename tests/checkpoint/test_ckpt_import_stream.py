"""``ckpt import`` into a job whose task streams its data: the weights and optimizer state
are kept and the position is the stream's beginning (world-size-free: bound by the first
worker start); a named step or epoch is refused with the fix."""

from __future__ import annotations

import pytest

from tests.cli.test_bad_args import assert_one_line_error
from tests.cli.test_first_week import _saved

pytestmark = pytest.mark.timeout(60)

JOB = """name: imported-stream
task: {target: 'tests.stream_task:TinyStream'}
nproc_per_node: 2
train: {steps: 6, global_batch_size: 4, micro_batch_size: 2}
"""


def _legacy(path):
    import torch

    from tests.stream_task import TinyStream

    torch.manual_seed(1)
    model = TinyStream().build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    torch.save({"model": {f"module.{k}": v for k, v in model.state_dict().items()},
                "optimizer": opt.state_dict(), "epoch": 2}, path)
    return model


def test_a_streaming_task_imports_at_the_streams_beginning(cli_here, tmp_path):
    import torch

    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    model = _legacy(tmp_path / "legacy.pt")
    r = cli_here("ckpt", "import", tmp_path / "legacy.pt", job, "--run-dir", tmp_path / "run")
    assert r.code == 0, r.err
    assert "optimizer state of 4 parameters, step 0)" in r.out
    assert "the file says epoch 2; this import starts at step 0: the task streams its data" in r.out
    (step_dir,) = (tmp_path / "run" / "checkpoints").glob("step-*")
    sd = _saved(step_dir, tmp_path)
    train = {k: int(v) for k, v in sd["train"].items()}
    assert train["step"] == 0 and train["cursor"] == 0
    assert train["dataset_size"] == 0 and train["stream"] == 0, "unbound: the first start binds it"
    for name, p in model.named_parameters():
        assert torch.equal(sd["model"][name], p.detach()), name


def test_a_streaming_task_refuses_a_named_position(cli_here, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    _legacy(tmp_path / "legacy.pt")
    r = cli_here("ckpt", "import", tmp_path / "legacy.pt", job, "--run-dir", tmp_path / "run", "--epoch", "2")
    assert_one_line_error(r, "streams its data: an import starts at the stream's beginning",
                          "import without --step/--epoch")
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_an_imported_stream_trains_and_a_changed_shard_list_is_refused_before_resuming(tmp_path):
    """The import trains from the stream's beginning at world size 2; a later run with a
    third shard is refused with the cause, and never says "resumed from" first."""
    from tests.conftest import cli

    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    _legacy(tmp_path / "legacy.pt")
    run_dir = tmp_path / "run"
    assert cli("ckpt", "import", str(tmp_path / "legacy.pt"), str(job), run_dir=run_dir).code == 0
    r = cli("run", str(job), "--set", "checkpoint.every_steps=3", run_dir=run_dir)
    assert r.code == 0, r.err
    assert "resumed from step 0, saved at world size 1, now 2" in r.out + r.err
    assert r.summary["steps"] == 6
    changed = cli("run", str(job), "--set", "task.args.shards=3", "--set", "train.steps=8", run_dir=run_dir)
    assert changed.code == 2, changed.err
    assert "shard list changed since the checkpoint" in changed.err
    assert "resumed from" not in changed.out + changed.err
