"""Keep a model's persistent buffers identical on every rank (rank 0's values).

Buffers such as BatchNorm's running statistics are updated by each rank's own forward
passes. DDP broadcasts rank 0's copy at the start of each forward, FSDP2 not at all, so at
a save the ranks hold different copies and DCP keeps whichever one its plan picks: a
resumed run would then continue from another rank's statistics than the uninterrupted run.
Broadcasting rank 0's buffers after every step makes the saved copy (and so the resumed
run, the final digest and the exported model) rank 0's, at any world size. Under DDP this
changes nothing the next forward would not do anyway; under FSDP2 it gives DDP's semantics.
Cost: one broadcast per buffer dtype per step, only for models that have buffers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from elastic_harness.torchcompat.nn import non_persistent_buffers


def persistent_buffers(model: nn.Module) -> list[torch.Tensor]:
    """Buffers that are part of the state dict (non-persistent ones are recomputed)."""
    out = []
    for module in model.modules():
        skip = non_persistent_buffers(module)
        out += [b for name, b in module.named_buffers(recurse=False) if name not in skip and b is not None]
    return out


class BufferSync:
    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self.groups: dict[tuple, list[torch.Tensor]] = {}
        for b in buffers:
            self.groups.setdefault((b.dtype, b.device), []).append(b)

    @classmethod
    def of(cls, model: nn.Module, dp_size: int) -> BufferSync | None:
        """Only when several data-parallel ranks (``runtime.topology``) read different samples:
        the ranks of one tensor-parallel group run the same forwards on the same data."""
        buffers = persistent_buffers(model)
        return cls(buffers) if buffers and dp_size > 1 else None

    def sync(self, group: object = None) -> None:
        """Every rank: overwrite each buffer with rank 0's copy (one broadcast per dtype).
        ``group`` None: every process (the data-parallel group under ``ddp``/``fsdp``)."""
        for tensors in self.groups.values():
            flat = torch.cat([t.reshape(-1) for t in tensors])
            dist.broadcast(flat, src=0, group=group)
            for t, synced in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
                t.copy_(synced.view_as(t))
