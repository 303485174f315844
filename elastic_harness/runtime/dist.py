"""Process groups for one worker generation: init with explicit values, always a timeout."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastic_harness.launch.env import WorkerEnv


@dataclass
class Groups:
    device: torch.device
    backend: str
    ckpt: Any  # a separate gloo group: async checkpoint collectives never interleave with training's


def choose_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            from elastic_harness.errors import HarnessError

            raise HarnessError("device: cuda requested but no GPU is visible", "set device: auto or cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init(env: WorkerEnv, device_request: str, timeout_s: int) -> Groups:
    """Initialise the default group (gloo on CPU; gloo+NCCL on GPU) and a gloo ckpt group."""
    device = choose_device(device_request, env.local_rank)
    # On GPU keep a CPU backend too: async checkpoint staging needs CPU collectives.
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    timeout = dt.timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    ckpt = dist.new_group(backend="gloo", timeout=timeout)
    return Groups(device=device, backend=backend, ckpt=ckpt)


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
