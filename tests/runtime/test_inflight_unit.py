"""The step in flight, finished without the lost rank (``runtime.inflight``): the lost share's
positions split over the survivors, and the local gradients the communication hook keeps."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from elastic_harness.data.sampler import EpochOrder, rank_share
from elastic_harness.runtime import inflight

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("g, old_dp, lost, survivors, micro", [(30, 3, [2], 2, 8), (30, 2, [1], 1, 8),
                                                                (32, 4, [1, 3], 2, 3), (7, 4, [0, 1], 3, 2)])
def test_the_lost_share_is_split_over_the_survivors_once_each_in_matching_micro_batches(g, old_dp, lost,
                                                                                         survivors, micro):
    order, cursor = EpochOrder(seed=5, dataset_size=50), 40  # the step crosses an epoch boundary
    plans = [inflight.extra_plan(order, cursor, g, old_dp, lost, survivors, me, micro) for me in range(survivors)]
    assert all(p is not None for p in plans)
    want = [p for r in lost for p in range(cursor + rank_share(g, old_dp, r)[0], cursor + rank_share(g, old_dp, r)[1])]
    got = sorted(pos for plan in plans for chunk in plan for pos, _ in chunk)
    assert got == want, "every lost position once, nothing else"
    assert all(idx == order.indices(pos, pos + 1)[0] for plan in plans for chunk in plan for pos, idx in chunk)
    assert len({len(plan) for plan in plans}) == 1, "as many micro-batches on every survivor"
    assert all(len(chunk) <= micro for plan in plans for chunk in plan)


def test_fewer_lost_samples_than_survivors_is_no_plan():
    assert inflight.extra_plan(EpochOrder(1, 10), 0, 4, 4, [1], 3, 0, 8) is None  # 1 sample, 3 survivors


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_hook_keeps_each_local_gradient_and_a_script_hook_is_a_reason(one_rank):
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(4, 3))
    kept = inflight.Kept()
    assert inflight.install(model, kept, lambda: dist.group.WORLD) is None and kept.hooked
    kept.begin(7)
    model(torch.randn(5, 4)).pow(2).sum().backward()
    params = list(model.parameters())
    assert set(kept.grads) == set(params)
    assert all(torch.equal(kept.grads[p], p.grad) for p in params), "one rank: the local gradient is the mean"
    local = {p: p.grad.clone() for p in params}
    for p in params:
        p.grad.zero_()  # a reduction that was left may have half-written a bucket
    assert kept.restore(model) and all(torch.equal(p.grad, local[p]) for p in params)

    other = DistributedDataParallel(nn.Linear(4, 3))
    other.register_comm_hook(None, lambda _state, bucket: torch.futures.Future().set_result(bucket.buffer()) or None)
    why = inflight.install(other, inflight.Kept(), lambda: dist.group.WORLD)
    assert why is not None and why.startswith("the model has a communication hook of its own")
    assert inflight.install(nn.Linear(2, 2), inflight.Kept(), lambda: None) == "the model is not DistributedDataParallel"


def _kept_on_two_ranks(rank: int, world: int, port: int, out: str, as_view: bool) -> None:
    from tests.runtime.test_live_groups import batch, join, model

    join(rank, world, port, live=False)
    ddp = DistributedDataParallel(model(), gradient_as_bucket_view=as_view, bucket_cap_mb=0.0001)  # a bucket per layer
    kept = inflight.Kept()
    assert inflight.install(ddp, kept, lambda: dist.group.WORLD) is None
    alone = model()
    for step in range(2):  # the second step runs on the buckets DDP rebuilt after the first
        kept.begin(step)
        ddp.zero_grad()
        alone.zero_grad()
        x = batch(step, rank, world)
        ddp(x).pow(2).sum().backward()
        alone(x).pow(2).sum().backward()
        local = [p.grad for p in alone.parameters()]
        mean = [g.clone() for g in local]
        for g in mean:
            dist.all_reduce(g)
            g.div_(world)
        params = list(ddp.parameters())
        assert all(torch.allclose(kept.grads[p], g) for p, g in zip(params, local, strict=True)), "kept: local"
        assert all(torch.allclose(p.grad, g) for p, g in zip(params, mean, strict=True)), "trained on: the mean"
    assert kept.copies == as_view
    with open(out, "a") as f:
        f.write(f"{rank}\n")
    # Ended here, before this frame's objects are freed: freeing ``ddp`` frees its reducer and
    # the gloo group with the GIL held, and that joins gloo's worker threads, one of which may
    # still be dropping the last collective's tensors, which needs the GIL (torch 2.13: hung
    # 1 run in 3 here, both ranks). A job's workers end with ``os._exit`` too
    # (``procexit.exit_without_teardown``), after their last checkpoint.
    os._exit(0)


@pytest.mark.e2e  # real processes
@pytest.mark.timeout(180)  # run_ranks waits 90 s for a rank: a hang is its failure, not pytest-timeout's
@pytest.mark.parametrize("as_view", [False, True])
def test_the_hook_keeps_the_local_gradients_of_a_real_reduction(tmp_path, as_view):
    """Two gloo ranks: after DDP's reduction the kept gradients are each rank's own, the
    parameters' the mean. DDP's default buckets keep the local values themselves (reduced out of
    place); buckets that are the gradients (``gradient_as_bucket_view``) are copied."""
    from tests.runtime.test_live_groups import run_ranks

    out = tmp_path / "done"
    assert run_ranks(_kept_on_two_ranks, 2, str(out), as_view) == [0, 0]
    assert sorted(out.read_text().split()) == ["0", "1"]
