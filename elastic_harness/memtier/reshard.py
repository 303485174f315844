"""Fill the live state from the snapshots of every rank of an older world size (``buddy``).

The snapshots hold each module's and optimizer's own state dicts (``runtime.state``: the
same tensors as DCP's, without its name mapping), so the pieces of one step line up by
position: the same keys, and at each position each old rank's local shard of one DTensor.
A DTensor's kind (``snapshot._kind``) names its global shape and placements; with a 1-D
mesh and ``Shard(d)`` the old rank ``r`` held rows ``Shard.local_shard_size_and_offset``
gives for (global size, old world size, ``r``), and this rank takes, for its own rows at the
new world size, the overlapping rows of each old piece: the same chunking DTensor and DCP
use, so the result equals a DCP load of that step resharded to this world size.
``Replicate`` tensors, plain tensors and plain values come from old rank 0's snapshot, as
DCP keeps rank 0's copy of what is not sharded.

Anything else (a 2-D mesh, another placement, a layout that differs by more than the world
size) raises ``Misfit`` before a byte is copied (``check``) so the ranks fall back to storage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from elastic_harness.memtier import snapshot
from elastic_harness.memtier.snapshot import TensorRef


class Misfit(ValueError):
    pass


Piece = tuple[Any, torch.Tensor, int]  # (skeleton, bytes, base): one old rank's snapshot


def rows(size: int, world_size: int, rank: int) -> tuple[int, int]:
    """Pure: (count, offset) of ``rank``'s rows of a dimension of ``size`` sharded over
    ``world_size`` ranks (DTensor's chunking; a rank past the end holds none)."""
    count, offset = Shard.local_shard_size_and_offset(size, world_size, rank)
    return int(count), int(offset)


def check(saved: Sequence[Any], target: Any, old_world: int, path: str = "") -> None:
    """Raise ``Misfit`` unless every old rank's skeleton (``saved[r]``) lines up with the
    live ``target`` tree: same keys and lengths; per tensor, the same dtype and, for a
    DTensor, global shape and placements (1-D, ``Shard``/``Replicate``), each old rank's
    local shape being its rows; for a plain tensor, the same shape."""
    first = saved[0]
    if isinstance(first, TensorRef):
        if not all(isinstance(s, TensorRef) for s in saved) or not isinstance(target, torch.Tensor):
            raise Misfit(f"{path or '.'}: tensors do not line up")
        if isinstance(target, DTensor):
            _check_dtensor(saved, target, old_world, path)
        elif any(s.kind != ("tensor",) or s.dtype != target.dtype or tuple(s.shape) != tuple(target.shape)
                 for s in saved):
            raise Misfit(f"{path}: a plain tensor's dtype or shape differs")
        return
    if isinstance(first, dict):
        if not isinstance(target, dict) or any(not isinstance(s, dict) or s.keys() != target.keys() for s in saved):
            raise Misfit(f"{path or '.'}: keys differ")
        for k in first:
            check([s[k] for s in saved], target[k], old_world, f"{path}/{k}")
        return
    if isinstance(first, (list, tuple)):
        if not isinstance(target, (list, tuple)) or any(
                not isinstance(s, (list, tuple)) or len(s) != len(target) for s in saved):
            raise Misfit(f"{path or '.'}: lengths differ")
        for i, t in enumerate(target):
            check([s[i] for s in saved], t, old_world, f"{path}/{i}")
        return
    if isinstance(target, torch.Tensor):
        raise Misfit(f"{path or '.'}: the state has a tensor where a plain value was saved")


def _check_dtensor(saved: Sequence[TensorRef], target: DTensor, old_world: int, path: str) -> None:
    placements = tuple(target.placements)
    if len(placements) != 1 or type(placements[0]) not in (Shard, Replicate):
        raise Misfit(f"{path}: placements {placements} (only a 1-D Shard or Replicate reshards in memory)")
    for r, s in enumerate(saved):
        if s.kind[0] != "dtensor" or s.dtype != target.dtype or tuple(s.kind[1]) != tuple(target.shape) \
                or tuple(s.kind[2]) != placements:
            raise Misfit(f"{path}: saved {s.dtype} {s.kind}, the state has {target.dtype} "
                         f"{tuple(target.shape)} {placements}")
        want = list(target.shape)
        if type(placements[0]) is Shard:
            d = placements[0].dim
            want[d] = rows(target.shape[d], old_world, r)[0]
        if tuple(s.shape) != tuple(want):
            raise Misfit(f"{path}: old rank {r} saved a shard of shape {tuple(s.shape)}, expected {tuple(want)}")


def fill(target: Any, pieces: Sequence[Piece], *, rank: int, world_size: int, path: str = "") -> Any:
    """Copy into ``target`` (checked by ``check``) this rank's part of the old pieces."""
    first = pieces[0][0]
    if isinstance(first, TensorRef):
        _fill_tensor(target, pieces, rank, world_size)
        return target
    if isinstance(first, dict):
        for k in first:
            target[k] = fill(target[k], [(s[k], d, b) for s, d, b in pieces], rank=rank, world_size=world_size)
        return target
    if isinstance(first, list):
        for i in range(len(first)):
            target[i] = fill(target[i], [(s[i], d, b) for s, d, b in pieces], rank=rank, world_size=world_size)
        return target
    if isinstance(first, tuple):
        return tuple(fill(target[i], [(s[i], d, b) for s, d, b in pieces], rank=rank, world_size=world_size)
                     for i in range(len(first)))
    return first


def _fill_tensor(target: torch.Tensor, pieces: Sequence[Piece], rank: int, world_size: int) -> None:
    local = target.to_local() if isinstance(target, DTensor) else target
    placement = target.placements[0] if isinstance(target, DTensor) else None
    if type(placement) is not Shard:  # Replicate or a plain tensor: old rank 0's
        ref, data, base = pieces[0]
        if ref.nbytes:
            local.copy_(snapshot._typed(data, base, ref))
        return
    copy_rows(local, placement.dim, target.shape[placement.dim], rank, world_size,
              [snapshot._typed(data, base, ref) for ref, data, base in pieces])


def copy_rows(local: torch.Tensor, dim: int, size: int, rank: int, world_size: int,
              old: Sequence[torch.Tensor]) -> None:
    """Fill ``local``, ``rank``'s shard along ``dim`` (of ``size`` in all) at ``world_size``,
    from ``old[r]``, old rank ``r``'s shard at ``len(old)`` ranks: each overlap once."""
    count, offset = rows(size, world_size, rank)
    for r, src in enumerate(old):
        old_count, old_offset = rows(size, len(old), r)
        lo, hi = max(offset, old_offset), min(offset + count, old_offset + old_count)
        if hi > lo:
            local.narrow(dim, lo - offset, hi - lo).copy_(src.narrow(dim, lo - old_offset, hi - lo))


def restore(state: dict[str, Any], pieces: Sequence[Piece], *, rank: int, world_size: int) -> None:
    """Check, fill and load every entry of ``state`` from the old ranks' ``pieces``."""
    trees = snapshot.targets(state)
    check([p[0] for p in pieces], trees, len(pieces))
    with torch.no_grad():
        for key in pieces[0][0]:
            trees[key] = fill(trees[key], [(s[key], d, b) for s, d, b in pieces], rank=rank, world_size=world_size)
    snapshot.load_entries(state, trees)
