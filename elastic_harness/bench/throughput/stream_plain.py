"""The plain side of ``bench throughput --stream``: a torchrun DDP script reading the same tar
shards as the harness side, split by rank (shards ``i % world == rank``, in order), through a
``DataLoader(batch_size=micro, num_workers=0)`` over an ``IterableDataset``: what a user
writes by hand, and which cannot resume mid-epoch or at another world size.

    python -m torch.distributed.run --standalone --nproc-per-node N \
        elastic_harness/bench/throughput/stream_plain.py --side plain --shards S.json --out O ...
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from elastic_harness.bench.throughput.stream import decoder, script_parser


def plain_main(args: argparse.Namespace) -> None:
    import contextlib

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader

    from elastic_harness.bench.throughput.common import StepClock, build_model, build_optimizer

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = DDP(build_model(args.hidden))
    optimizer = build_optimizer(model)
    batches = iter(DataLoader(rank_shards(args, rank, world), batch_size=args.micro_batch, num_workers=0))
    accumulate = args.global_batch // (world * args.micro_batch)
    clock = StepClock(rank, world)
    for _ in range(args.steps):
        clock.tick()
        for i in range(accumulate):
            x, y = next(batches)
            with contextlib.nullcontext() if i == accumulate - 1 else model.no_sync():
                (F.cross_entropy(model(x), y) / accumulate).backward()
            clock.count(len(y))
        optimizer.step()
        optimizer.zero_grad()
    clock.finish(args.out, side="plain", accumulate=accumulate)
    dist.barrier()  # a clean end, as in plain.py: every rank done, DDP's reducer gone first
    del model, optimizer
    dist.destroy_process_group()


def rank_shards(args: argparse.Namespace, rank: int, world: int):
    """An ``IterableDataset`` of this rank's shards (``i % world == rank``), in order, epoch
    after epoch: the same tar parsing (``tar_stream``) and decoding (``decoder``: costly is
    JPEG decode + augmentation) as the harness side, nothing else."""
    from torch.utils.data import IterableDataset

    from elastic_harness.data.adapters import tar_stream

    shards = json.loads(Path(args.shards).read_text())
    reader, decode = tar_stream(shards), decoder(args.data)

    class RankShards(IterableDataset):
        def __iter__(self):
            while True:
                for path in shards[rank::world]:
                    for sample in reader.open(path):
                        yield decode(sample)

    return RankShards()


if __name__ == "__main__":
    plain_main(script_parser().parse_args())
