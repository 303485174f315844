"""The step in flight across HSDP replicas (``runtime.inflight.KeptShards``), on live groups:
four real gloo ranks, a (dp_replicate 2, dp_shard 2) mesh, FSDP2 on it. Each rank keeps its
replica's shard-local gradient of the step before the replica all-reduce (deferred to the
step's end); when replica 1 (ranks 2 and 3, one node) dies in the step's backward pass or in its
replica all-reduce, the survivors re-form at world size 2, compute the lost replica's samples as
extra micro-batches at the new membership and add their kept gradients (``reduce_kept``): the
gradient is the mean over the step's 16 samples, as the uninterrupted step's. Also when the
survivors' agent tells them of the loss before their own backward has reduce-scattered anything
(``told``): the word of another node's loss leaves the shard group running until the node is
past its backward (``KeptShards.holding``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elastic_harness.runtime import generations, inflight
from tests.runtime.test_live_groups import TIMEOUT, free_port, join, model, run_ranks

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]  # real processes

G, R, S = 16, 2, 2  # samples of the step, replicas, shards per replica


def data() -> torch.Tensor:
    return torch.randn(G, 8, generator=torch.Generator().manual_seed(3))


def per_rank(rank: int, world: int) -> torch.Tensor:
    n = G // world
    return data()[n * rank:n * (rank + 1)]


def scaled_loss(m, x: torch.Tensor, dp: int) -> torch.Tensor:
    """A micro-batch's share of the step's mean (``Step.scale``: summed, times dp / G)."""
    return m(x).pow(2).sum() * (dp / G)


def _hsdp(world: int, shape: tuple[int, int]):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard"))
    m = fully_shard(model(), mesh=mesh if shape[0] > 1 else mesh["dp_shard"])
    return mesh, m


def _locals(m) -> dict[str, list]:
    return {n: p.grad.to_local().tolist() for n, p in m.named_parameters()}


def _fault_free(rank, world, port, out):
    join(rank, world, port, True)
    mesh, m = _hsdp(world, (R, S))
    kept = inflight.KeptShards(mesh["dp_replicate"].get_group(), mesh["dp_shard"].get_group()).install()
    _, native = _hsdp(world, (R, S))  # FSDP2's own replica all-reduce (outside begin .. end)
    scaled_loss(native, per_rank(rank, world), R * S).backward()
    kept.begin(1)
    scaled_loss(m, per_rank(rank, world), R * S).backward()
    kept.end(m)
    assert kept.kept is not None
    Path(f"{out}.{rank}").write_text(json.dumps({"kept": {n: t.tolist() for n, t in kept.kept.items()},
                                                 "grad": _locals(m), "native": _locals(native)}))


def _die(*_args) -> None:
    import os

    os._exit(3)


def _told(gens, kept):
    """A hook that gives this rank its agent's word of another node's loss, as the control line
    does (``Recovery._left``, remote), before the backward pass has reduce-scattered anything."""
    import socket

    from elastic_harness.runtime.control import Control
    from elastic_harness.runtime.inplace import Recovery

    recovery = Recovery(Control(socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)[0]), gens, 30.0,
                        holding=kept.holding)

    def hook(grad):
        recovery._left("node 1 is gone", remote=True)
        return grad
    return hook


def _lost_replica(rank, world, port, out, port2, during):
    join(rank, world, port, True)
    gens = generations.current()
    mesh, m = _hsdp(world, (R, S))
    kept = inflight.KeptShards(mesh["dp_replicate"].get_group(), mesh["dp_shard"].get_group()).install()
    kept.begin(1)
    loss = scaled_loss(m, per_rank(rank, world), R * S)
    if rank >= S and during in ("backward", "told"):
        loss.register_hook(_die)  # replica 1's node dies as its backward pass begins
    if rank < S and during == "told":
        loss.register_hook(_told(gens, kept))  # the survivors' agent says so before their reduce-scatters
    loss.backward()
    if rank >= S:
        _die()  # ... or as the replica all-reduce starts
    kept.end(m)  # the replica all-reduce fails here: nothing raises
    assert gens.broken is not None
    gens.leave("replica 1 is lost")  # what the agent's word does
    local = kept.kept
    assert local is not None, "the survivors hold their shard-local gradients"
    store2 = dist.TCPStore("127.0.0.1", port2, S, rank == 0, timeout=TIMEOUT)
    gens.reform(store2, rank, S, generations.tag_of(port2))
    mesh2, m2 = _hsdp(S, (1, S))  # built again for one replica, from the step-before state
    lost = data()[G // R:]  # replica 1's samples, split over the two survivors
    scaled_loss(m2, lost[rank * (G // R // S):(rank + 1) * (G // R // S)], S).backward()
    inflight.reduce_kept(m2, local, mesh2["dp_replicate"].get_group(), R)
    full = {n: p.grad.full_tensor().tolist() for n, p in m2.named_parameters()}
    if rank == 0:
        Path(out).write_text(json.dumps(full))


def reference() -> dict[str, torch.Tensor]:
    """The step's gradient: the mean over its G samples, in one process."""
    m = model()
    (m(data()).pow(2).sum() / G).backward()
    return {n: p.grad for n, p in m.named_parameters()}


def test_each_rank_keeps_its_replicas_shard_local_gradient_before_the_replica_all_reduce(tmp_path):
    out = tmp_path / "kept"
    assert run_ranks(_fault_free, R * S, str(out)) == [0] * (R * S)
    got = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(R * S)]
    full = reference()
    for s in range(S):
        for name, want in full.items():
            kept = [torch.tensor(got[r * S + s]["kept"][name]) for r in range(R)]
            grad = torch.tensor(got[s]["grad"][name])
            assert torch.allclose(sum(kept) / R, grad, atol=1e-7), name  # the replica average
            assert torch.allclose(grad, torch.tensor(got[s]["native"][name]), rtol=1e-6, atol=1e-8), name
            assert torch.allclose(grad, torch.chunk(want, S)[s], atol=1e-6), name
            assert not torch.allclose(kept[0], grad, atol=1e-6), f"{name}: kept before the all-reduce"


@pytest.mark.parametrize("during", ["backward", "reduction", "told"])
def test_the_survivors_finish_the_step_of_a_lost_replica_with_the_mean_of_its_samples(tmp_path, during):
    out = tmp_path / "finished.json"
    codes = run_ranks(_lost_replica, R * S, str(out), free_port(), during, awaited=(0, 1, 2, 3))
    assert codes == [0, 0, 3, 3]
    got = json.loads(out.read_text())
    for name, want in reference().items():
        assert torch.allclose(torch.tensor(got[name]), want, atol=1e-6), name
