"""The step in flight, finished without the lost rank (in-place recovery; docs/in-place.md).

Under DDP each rank computes its share of a step's global batch and only then reduces the
gradients. A node that dies in the middle of a step takes its share with it, but every
survivor has computed its own: ``Kept`` keeps each survivor's local gradient of the step (a
DDP communication hook, torch's public way, reduces a copy of each bucket and leaves the
bucket itself, the local gradients, as it was). When the generation breaks under the step,
the survivors re-form without the lost rank (``runtime.inplace``), put their local gradients back, compute the lost share's samples
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
all-reduces the result across replicas. The replica group defers that all-reduce to the step's
end (``torchcompat.groups``: ``Lineage.defer``), where a copy is kept before it runs: the
survivors hold their replica's shard-local gradient of the step, 1/shard of the model. Finishing: the lost replicas' share as extra micro-batches at
the new membership (FSDP2 reduces those as usual), then ``reduce_kept`` adds the kept shard-local
gradients summed over the surviving replicas, divided by the step's own replica count.
"""

from __future__ import annotations

from collections.abc import Callable
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
        # DDP's buckets are the parameters' gradients (``gradient_as_bucket_view``): the
        # reduced result is written back into them, so they are copied to be kept
        self.copies = True
        self._out: dict[int, torch.Tensor] = {}  # by bucket: where it is reduced, out of place

    def begin(self, step: int) -> None:
        self.grads, self.step = {}, step

    def hook(self, group_of, bucket):  # noqa: ANN001, ANN201 - DDP checks these annotations, as objects
        """DDP's communication hook: keep the bucket's local gradients, then reduce it as
        DDP's default hook does (divided by the group's size, summed). Unannotated: DDP
        refuses an annotation it cannot compare (this module's are strings).

        Without ``copies`` (DDP's default, buckets apart from the gradients) nothing is copied
        to keep them: the bucket is reduced out of place (the division writes the copy the
        default hook's in-place division would not), DDP copies that result into the
        gradients, and the bucket itself keeps the local values until the next step's
        backward fills it (a copy of every gradient took ~4 ms of a ~60 ms step in a CPU micro-bench here)."""
        buffer = bucket.buffer()
        for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
            self.grads[param] = grad.detach().clone() if self.copies else grad.detach()
        fire_armed("reduction")  # a chaos fault keyed to this reduction, if armed (runtime.faults)
        group = group_of()
        if self.copies:
            reduced = buffer.div_(group.size())
        else:
            reduced = self._out.get(bucket.index())
            if reduced is None or reduced.shape != buffer.shape or reduced.dtype != buffer.dtype \
                    or reduced.device != buffer.device:
                reduced = self._out[bucket.index()] = torch.empty_like(buffer)
            torch.div(buffer, group.size(), out=reduced)
        work = dist.all_reduce(reduced, group=group, async_op=True)
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
    degree), all-reduces the result in place over the replica group (AVG again) and makes each
    parameter's gradient a view of it. During a step's micro-batches (``begin`` .. ``end``) the
    replica group defers those all-reduces (``torchcompat.groups``: ``Lineage.defer``): the
    backward pass meets only the ranks of its own node, and its gradients stay shard-local.
    ``end`` keeps a copy of them, then all-reduces every gradient at once over the replica
    group (AVG: what FSDP2's would have done; a gradient FSDP2 reduced itself, under another
    op, is equal on every replica and averages to itself). FSDP2's own switch,
    ``set_requires_all_reduce(False)``, is not used: it writes no gradient, the
    reduce-scattered result stays in a private buffer of the parameter group until a later
    backward all-reduces it (it is made for gradient accumulation).

    The copy is the step's only when every collective of the shard group in the step ran
    (``Lineage.skipped`` unchanged: a reduce-scatter left on a broken generation wrote
    nothing) and every replica all-reduce of it was deferred. The shard group is the node (a
    node is a replica, tensor degree 1: ``runtime.repoint`` installs it only there).
    """

    def __init__(self, replicate: Any, shard: Any) -> None:
        self.group, self.node = replicate, shard  # the mesh's replica and shard groups (LiveGroups)
        self.replicate, self.shard = replicate.lineage, shard.lineage
        self.kept: dict[str, torch.Tensor] | None = None  # the step's shard-local gradients, by name
        self.step = -1
        self._deferring = False
        self._holding = False  # from ``begin`` until the node is past its backward (``holding``)
        self._native = False  # some all-reduce of the step was not deferred (another op)
        self._skipped = self.shard.skipped
        self.on_begin: Callable[[int], None] = lambda step: None  # a test's forced lateness (``inplace``)

    def install(self) -> KeptShards:
        self.replicate.defer = self._defer
        return self

    def begin(self, step: int) -> None:
        """A step's micro-batches start."""
        self.kept, self.step, self._deferring, self._native = None, step, True, False
        self._holding = True
        self._skipped = self.shard.skipped
        self.on_begin(step)

    def holding(self) -> tuple:
        """The groups a word of another node's loss leaves running now: the shard group (this
        node) from ``begin`` until every rank of the node is past its backward (``end``'s
        barrier). Its reduce-scatters then complete, and the copy is whole."""
        return (self.shard,) if self._holding else ()

    def _release(self) -> None:
        """Past the backward: a shard group left running through a word of a loss is left now,
        before anything else of this rank meets the node on it (the word's leave checks
        ``holding`` again after it, so one of the two leaves it, whichever thread is first)."""
        self._holding = False
        if self.replicate.broken is not None:
            self.shard.leave(self.replicate.broken)

    def _defer(self, tensors: Any, opts: Any) -> bool:
        if not self._deferring:
            return False
        if opts.reduceOp != dist.ReduceOp.AVG:
            self._native = True
            return False
        return True

    def end(self, model: nn.Module | None) -> None:
        """The step's last backward is done: keep the shard-local gradients, then reduce them
        over the replicas (the chaos point ``reduction`` fires in between). ``model`` None, or
        called twice: only stop deferring (a loop left early)."""
        if not self._deferring or model is None:
            self._deferring = False
            self._release()
            return
        self._deferring = False
        grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
        intact = self.shard.skipped == self._skipped and not self._native
        self.kept = ({name: _local(p.grad).clone() for name, p in model.named_parameters() if p.grad is not None}
                     if intact else None)
        # No rank of the node meets another node before all of them are past their backward: a
        # rank that fails there first leaves its groups (and its agent tells the node's others
        # to leave), which would cut a slower neighbour's reduce-scatter short.
        dist.barrier(group=self.node)
        self._release()
        fire_armed("reduction")  # a chaos fault keyed to this reduction, if armed (runtime.faults)
        if grads:
            _all_reduce_into(grads, self.group, dist.ReduceOp.AVG)


def _local(grad: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's gradients), else the tensor."""
    return grad.to_local() if hasattr(grad, "to_local") else grad


def _all_reduce_into(tensors: list[torch.Tensor], group: Any, op: Any) -> torch.Tensor:
    """One all-reduce of ``tensors`` (flattened together) over ``group``, written back; the flat sum."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, op=op, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    return flat


def reduce_kept(model: nn.Module, kept: dict[str, torch.Tensor], group: Any, old_replicas: int) -> None:
    """Finish an HSDP step: add to every gradient (the extra micro-batches', reduced at the new
    membership) the kept shard-local gradients summed over the surviving replicas (one all-reduce
    over ``group``, the new replica group) and divided by the step's own replica count: each
    replica's kept value is ``replicas / G`` times its samples' gradient sum (the loss scale
    ``dp / G`` times the shard average), so the result is the mean over the step's ``G`` samples."""
    named = [(param, kept[name]) for name, param in model.named_parameters() if name in kept]
    if not named:
        return
    sums = [k.clone() for _, k in named]
    _all_reduce_into(sums, group, dist.ReduceOp.SUM)
    for (param, _), total in zip(named, sums, strict=True):
        _local(param.grad).add_(total.div_(old_replicas))


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
    kept.copies = bool(getattr(model, "gradient_as_bucket_view", True))
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
