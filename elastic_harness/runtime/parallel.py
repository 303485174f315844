"""Wrap a model for the layout (``runtime.topology``): DDP or FSDP2 (the task path)."""

from __future__ import annotations

import torch
from torch import nn

from elastic_harness.runtime.topology import Topology


def wrap(model: nn.Module, topology: Topology, device: torch.device, task: object) -> nn.Module:
    """``ddp``: one replica per process; ``fsdp``: FSDP2 over the shard dimension (the whole
    world under ``fsdp``)."""
    model = model.to(device)
    if topology.kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [device.index] if device.type == "cuda" else None
        return DDP(model, device_ids=ids)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # An explicit mesh on the chosen device: FSDP2's default mesh is on CUDA whenever a GPU
    # is visible, which breaks CPU training on a GPU host ("invalid device ordinal").
    mesh = init_device_mesh(device.type, (topology.shard,))
    # Shard the task's units (e.g. transformer blocks) first, then the root.
    units = getattr(task, "shard_units", None)
    for unit in units(model) if units else []:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model

