"""The plain side of ``bench throughput``: a faithful torchrun DDP script, nothing of ours
in its loop. ``DistributedSampler`` + ``DataLoader(num_workers=0)`` (items are loaded in
the training process, as in most users' first script), gradient accumulation with
``no_sync`` over the micro-batches of a step, ``loss.backward()``, ``optimizer.step()``,
the loss printed every ``--log-every`` steps. No checkpoints, unless ``--save-every N``:
then rank 0 ``torch.save``s the model and optimizer state every N steps, synchronously,
over one file (``--save-dir/ckpt.pt``), as plain scripts commonly do.

    python -m torch.distributed.run --standalone --nproc-per-node N \
        -m elastic_harness.bench.throughput.plain --data cheap --data-dir D --out O \
        --steps S --global-batch G --micro-batch M
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from elastic_harness.bench.throughput.common import (
    StepClock,
    build_model,
    build_optimizer,
    parse_args,
)
from elastic_harness.bench.throughput.data import open_images


def forever(loader: DataLoader, sampler: DistributedSampler) -> Iterator:
    """Micro-batches across epochs (a new shuffle each epoch)."""
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = _wrapped(args, world)
    optimizer = build_optimizer(model)
    data = open_images(args.data, args.data_dir)
    sampler = DistributedSampler(data, seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=args.micro_batch, sampler=sampler, drop_last=True)
    accumulate = args.global_batch // (world * args.micro_batch)
    batches = forever(loader, sampler)
    clock = StepClock(rank, world)
    for step in range(args.steps):
        clock.tick()
        for i in range(accumulate):
            x, y = next(batches)
            with _sync(model, args, i == accumulate - 1):
                loss = F.cross_entropy(model(x), y) / accumulate
                loss.backward()
            clock.count(len(y))
        clock.mark("compute")
        optimizer.step()
        optimizer.zero_grad()
        clock.mark("optimizer")
        if rank == 0 and (step + 1) % args.log_every == 0:
            print(f"step {step + 1} loss {loss.item() * accumulate:.4f}", flush=True)
        if rank == 0 and args.save_every and (step + 1) % args.save_every == 0:
            _save(model, optimizer, step + 1, Path(args.save_dir) / "ckpt.pt")
        clock.mark("hook")
    clock.finish(args.out, side="plain", accumulate=accumulate)
    # A clean end, as a careful script writes it: every rank done, DDP's reducer (which holds
    # the group) gone before the group. Without this, 1 exit in 5-10 here ended in
    # "terminate called without an active exception" (SIGABRT) after the measurement.
    dist.barrier()
    del model, optimizer
    dist.destroy_process_group()


def _wrapped(args, world: int) -> torch.nn.Module:
    """DDP, or (the hsdp row) FSDP2 on a (replicate, shard) mesh, as a torchrun user writes HSDP."""
    if not args.hsdp_shard:
        return DDP(build_model(args.hidden))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world // args.hsdp_shard, args.hsdp_shard),
                            mesh_dim_names=("dp_replicate", "dp_shard"))
    return fully_shard(build_model(args.hidden), mesh=mesh)


def _sync(model: torch.nn.Module, args, last: bool) -> contextlib.AbstractContextManager:
    """Gradients all-reduced on a step's last micro-batch only (FSDP2's flag, DDP's ``no_sync``)."""
    if args.hsdp_shard:
        model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()
    return contextlib.nullcontext() if last else model.no_sync()


def _save(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, path: Path) -> None:
    """What a plain script does (nanoGPT's ckpt.pt): rank 0, synchronous, overwritten."""
    torch.save({"model": getattr(model, "module", model).state_dict(), "optimizer": optimizer.state_dict(),
                "step": step}, path)


if __name__ == "__main__":
    main()
