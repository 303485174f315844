"""Wrap a model for the current world size: DDP or FSDP2 (the task path)."""

from __future__ import annotations

import torch
from torch import nn


def wrap(model: nn.Module, kind: str, device: torch.device, task: object, world_size: int) -> nn.Module:
    model = model.to(device)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [device.index] if device.type == "cuda" else None
        return DDP(model, device_ids=ids)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # An explicit mesh on the chosen device: FSDP2's default mesh is on CUDA whenever a GPU
    # is visible, which breaks CPU training on a GPU host ("invalid device ordinal").
    mesh = init_device_mesh(device.type, (world_size,))
    # Shard the task's units (e.g. transformer blocks) first, then the root.
    units = getattr(task, "shard_units", None)
    for unit in units(model) if units else []:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model

