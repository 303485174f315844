"""``runtime.seeding.seed_torch``: ``torch.manual_seed``'s effect on the generators the
harness uses, without the stack capture that made seeding per step and per item slow."""

from __future__ import annotations

import traceback

import pytest
import torch

from elastic_harness.runtime.seeding import seed_torch

pytestmark = pytest.mark.timeout(60)


def test_seed_torch_seeds_like_manual_seed_without_capturing_the_stack(monkeypatch):
    if torch.cuda.is_available() and not torch.cuda.is_initialized():
        pytest.skip("CUDA could still start here: seed_torch queues the seed the slow way, on purpose")
    seed_torch(123)
    a = torch.rand(4)
    torch.manual_seed(123)
    assert torch.equal(a, torch.rand(4))

    def no_stacks(*_a, **_k):
        raise AssertionError("traceback.format_stack called")

    monkeypatch.setattr(traceback, "format_stack", no_stacks)
    seed_torch(5)  # the per-step and per-item seed: no stack capture
    with pytest.raises(AssertionError, match="format_stack"):
        torch.manual_seed(5)  # what it replaces (this is why it was slow)


def test_a_built_model_starts_from_the_jobs_seed_without_capturing_the_stack(monkeypatch):
    """``worker.build_model`` seeds with ``seed_torch``: the same initial weights as after
    ``torch.manual_seed(seed)`` whatever the RNG did before, and no stack capture on the way
    (it was a few ms of every worker's start)."""
    import torch.distributed as dist

    from elastic_harness.runtime.topology import Topology
    from elastic_harness.runtime.worker import build_model
    from elastic_harness.spec import load_job
    from elastic_harness.tasks import load_task
    from tests.conftest import JOBS

    if torch.cuda.is_available() and not torch.cuda.is_initialized():
        pytest.skip("CUDA could still start here: seed_torch queues the seed the slow way, on purpose")
    spec = load_job(JOBS / "mlp.yaml")
    task = load_task(spec.task.target, spec.task.args)
    torch.manual_seed(spec.train.seed)
    expected = task.build_model().state_dict()

    def no_stacks(*_a, **_k):
        raise AssertionError("traceback.format_stack called")

    torch.rand(7)  # the RNG has moved on, as it has in a worker that loaded data first
    monkeypatch.setattr(traceback, "format_stack", no_stacks)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = build_model(task, spec, torch.device("cpu"), Topology.build(1, 1, 1, "ddp", rank=0))
        got = model.module.state_dict()
    finally:
        dist.destroy_process_group()
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
