"""The step in flight, finished without the lost rank (in-place recovery; docs/in-place.md).

Under DDP each rank computes its share of a step's global batch and only then reduces the
gradients. A node that dies in the middle of a step takes its share with it, but every
survivor has computed its own: ``Kept`` keeps each survivor's local gradient of the step (a
DDP communication hook, torch's public way, copies a bucket's local tensor before it is
reduced). When the generation breaks under the step, the survivors re-form without the lost
rank (``runtime.inplace``), put their local gradients back, compute the lost share's samples
among themselves as extra micro-batches (``extra_plan``: the same positions of the same step,
split over the survivors), reduce at the new membership and divide by the step's own
data-parallel degree: the update is the mean over the same ``G`` samples the uninterrupted
run used (in another order of additions; docs/tolerance.md). No healthy rank computes again a
micro-batch it had finished.

Call order, per step, on every rank: ``Kept.begin`` when the step starts; the hook keeps the
local gradients as the last micro-batch's backward reduces them; after a re-formation,
``Kept.restore`` (the local gradients back), the extra micro-batches' backward with gradient
synchronisation off, then ``reduce`` (one all-reduce of every gradient).

Across HSDP replicas (``KeptShards``) the same holds one level up: a node is a whole replica,
sharded inside, and FSDP2 reduce-scatters a step's gradients within the node before it
all-reduces the result across replicas. The replica group's tap (``torchcompat.groups``) keeps
each buffer before that all-reduce: the survivors hold their replica's shard-local gradient of
the step, 1/shard of the model. Finishing: the lost replicas' share as extra micro-batches at
the new membership (FSDP2 reduces those as usual), then ``reduce_kept`` adds the kept shard-local
gradients summed over the surviving replicas, divided by the step's own replica count.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elastic_harness.data.sampler import EpochOrder, micro_batches, rank_share, split
from elastic_harness.runtime.faults import fire_armed


class Kept:
    """The local (not yet reduced) gradients of this rank's current step, by parameter."""

    def __init__(self) -> None:
        self.grads: dict[nn.Parameter, torch.Tensor] = {}
        self.step = -1  # the step they belong to (its number once done)
        self.hooked = False

    def begin(self, step: int) -> None:
        self.grads, self.step = {}, step

    def hook(self, group_of, bucket):  # noqa: ANN001, ANN201 - DDP checks these annotations, as objects
        """DDP's communication hook: keep the bucket's local gradients, then reduce it as
        DDP's default hook does (divided by the group's size, summed). Unannotated: DDP
        refuses an annotation it cannot compare (this module's are strings)."""
        for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
            self.grads[param] = grad.detach().clone()
        fire_armed("reduction")  # a chaos fault keyed to this reduction, if armed (runtime.faults)
        group = group_of()
        buffer = bucket.buffer()
        buffer.div_(group.size())
        work = dist.all_reduce(buffer, group=group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    def restore(self, model: nn.Module) -> bool:
        """Put the kept local gradients back (a reduction that was left may have written a
        bucket half-way); False when some parameter with a gradient has none kept."""
        for param in model.parameters():
            if param.grad is None:
                continue
            kept = self.grads.get(param)
            if kept is None:
                return False
            param.grad.copy_(kept)
        return True


class KeptShards:
    """HSDP: this rank's shard-local gradients of the current step, before the replica all-reduce.

    FSDP2 (torch 2.13, ``_fsdp_collectives.foreach_reduce``) reduce-scatters a parameter group's
    gradients over the shard group (ReduceOp.AVG in float32/bfloat16: divided by the shard
    degree), all-reduces that buffer in place over the replica group (AVG again) and makes each
    parameter's gradient a view of it. ``keep`` (the replica group's tap) copies the buffer before
    its all-reduce is launched; ``local`` finds each gradient's copy by its storage. FSDP2's own
    switch, ``set_requires_all_reduce(False)``, would skip the all-reduce but writes no gradient:
    the reduce-scattered result stays in a private buffer of the parameter group until a later
    backward all-reduces it (it is made for gradient accumulation), so it is not used here.
    The copies are the step's only when every work of the shard group since ``begin`` ran
    (``intact``): a reduce-scatter left on a broken generation wrote nothing.
    """

    def __init__(self, replicate: Any, shard: Any) -> None:
        self.replicate, self.shard = replicate.lineage, shard.lineage  # of the mesh's LiveGroups
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []  # (all-reduced buffer, its copy)
        self.step = -1
        self._skipped = self.shard.skipped

    def install(self) -> KeptShards:
        self.replicate.tap = self.keep
        return self

    def begin(self, step: int) -> None:
        self.buffers, self.step, self._skipped = [], step, self.shard.skipped

    def keep(self, tensors: list[torch.Tensor]) -> None:
        """The replica group's tap: copy each buffer before it is all-reduced."""
        self.buffers.extend((t, t.detach().clone()) for t in tensors)
        fire_armed("reduction")  # a chaos fault keyed to this reduction, if armed (runtime.faults)

    def intact(self) -> bool:
        """Did every collective of the shard group since ``begin`` run (none left or failed)?"""
        return self.shard.skipped == self._skipped

    def local(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """Every gradient's shard-local value before the replica all-reduce, by parameter name;
        None when some gradient is not a view of a kept buffer (accumulated into a gradient
        that existed, cast to another dtype) or the shard group's collectives did not all run."""
        if not self.intact():
            return None
        out: dict[str, torch.Tensor] = {}
        for name, param in model.named_parameters():
            if param.grad is None:
                continue
            grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
            copy = self._copy_of(grad)
            if copy is None:
                return None
            out[name] = copy
        return out

    def _copy_of(self, grad: torch.Tensor) -> torch.Tensor | None:
        ptr = grad.untyped_storage().data_ptr()
        for buffer, copy in self.buffers:
            if buffer.untyped_storage().data_ptr() == ptr and buffer.is_contiguous():
                offset = grad.storage_offset() - buffer.storage_offset()
                return copy.as_strided(grad.size(), grad.stride(), copy.storage_offset() + offset).clone()
        return None


def reduce_kept(model: nn.Module, kept: dict[str, torch.Tensor], group: Any, old_replicas: int) -> None:
    """Finish an HSDP step: add to every gradient (the extra micro-batches', reduced at the new
    membership) the kept shard-local gradients summed over the surviving replicas (one all-reduce
    over ``group``, the new replica group) and divided by the step's own replica count: each
    replica's kept value is ``replicas / G`` times its samples' gradient sum (the loss scale times
    the shard average), so the result is the mean over the step's ``G`` samples."""
    named = [(param, kept[name]) for name, param in model.named_parameters() if name in kept]
    if not named:
        return
    flat = torch.cat([k.reshape(-1) for _, k in named])
    dist.all_reduce(flat, group=group)
    flat.div_(old_replicas)
    offset = 0
    for param, k in named:
        grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
        grad.add_(flat[offset:offset + k.numel()].view_as(grad))
        offset += k.numel()


def install(model: nn.Module, kept: Kept, group_of: Any) -> str | None:
    """Keep ``model``'s local gradients (a DDP model, whose hook slot is free); why not, or None."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return "the model is not DistributedDataParallel"
    try:
        model.register_comm_hook(group_of, kept.hook)
    except RuntimeError as e:  # DDP takes one hook: the script's own (compression, ...)
        return f"the model has a communication hook of its own ({str(e)[:80]})"
    kept.hooked = True
    return None


def extra_plan(order: EpochOrder, cursor: int, global_batch: int, old_dp: int, lost: list[int],
               survivors: int, me: int, micro_batch: int) -> list[list[tuple[int, int]]] | None:
    """Pure: the micro-batches of the lost data-parallel ranks' shares of the step that
    started at ``cursor`` that survivor ``me`` (of ``survivors``) computes: their positions,
    in order, split over the survivors, then into micro-batches of at most ``micro_batch``,
    as many on every survivor (a DDP forward may broadcast buffers: collectives must match).
    None when the lost shares hold fewer samples than there are survivors (some would have
    none: the step is redone instead)."""
    positions: list[int] = []
    for r in sorted(lost):
        lo, hi = rank_share(global_batch, old_dp, r)
        positions.extend(range(cursor + lo, cursor + hi))
    if len(positions) < survivors:
        return None
    mine = split(positions, survivors)[me]
    pairs = list(zip(mine, (int(i) for i in order.indices(mine[0], mine[-1] + 1)), strict=True))
    return split(pairs, micro_batches(len(positions), survivors, micro_batch))


def reduce(model: nn.Module, group: Any, divisor: int) -> None:
    """One all-reduce (sum) of every gradient over ``group``, divided by ``divisor`` (the
    step's own data-parallel degree: the loss of each micro-batch was scaled for it)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat.div_(divisor)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
