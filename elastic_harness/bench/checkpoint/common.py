"""What both halves of ``bench checkpoint``'s ranks share (``checkpoint.ranks``, ``checkpoint.train``).

The event sink, the slowest-rank timer, the sharded view of the test state, the raw-write
baseline and the saver under test. Imports nothing else of the bench, so neither half
imports the other back.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from elastic_harness.checkpoint.collective import Ranks
from elastic_harness.checkpoint.manager import Checkpoints, Saver
from elastic_harness.checkpoint.site import Site
from elastic_harness.checkpoint.storage import LocalStorage
from elastic_harness.spec import CheckpointSpec


class Events:
    """Collects the manager's events in memory (rank 0 emits)."""

    def __init__(self) -> None:
        self.seen: list[dict] = []

    def emit(self, event: str, **fields: Any) -> dict:
        self.seen.append({"event": event, **fields})
        return fields


def timed(fn, group: Any) -> float:
    """Seconds ``fn`` took on the slowest rank of ``group``."""
    dist.barrier(group=group)
    t0 = time.perf_counter()
    fn()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def sharded(full: dict, mesh: DeviceMesh, rank: int, world: int, fill: bool, dim: int = 0) -> dict:
    """The DTensor view of ``full`` over ``mesh`` (Shard(dim): 0 as FSDP2 shards, 1 as a
    tensor-parallel row split of a weight); zeros unless ``fill``."""
    out: dict = {}
    for part, tensors in full.items():
        out[part] = {}
        for name, t in tensors.items():
            chunks = t.chunk(world, dim=dim)
            local = chunks[rank].clone() if rank < len(chunks) else t.new_zeros(0, t.shape[1])
            if not fill:
                local.zero_()
            out[part][name] = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False,
                                                 shape=t.shape, stride=t.stride())
    return out


def raw_write(path: Path, tensors: list[torch.Tensor]) -> None:
    """The same bytes DCP writes for this rank, with DCP's fsync semantics."""
    with open(path, "wb") as f:
        for t in tensors:
            f.write(t.reshape(-1).view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path.parent, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def local_tensors(state: dict) -> list[torch.Tensor]:
    return [d.to_local() for part in state.values() for d in part.values()]


def make_saver(rank: int, root: Path, group: Any, async_save: bool, events: Events) -> Saver:
    storage = LocalStorage(root)
    storage.ensure()
    policy = CheckpointSpec(keep=2, async_save=async_save, verify="size")
    site = Site(storage, Ranks(rank, 2, group), events, {"task": "bench", "job": "bench"})
    return Checkpoints.build(site, policy).saver
