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
