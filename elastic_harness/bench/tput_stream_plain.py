"""The plain side of ``bench throughput --stream``: a torchrun DDP script reading the same tar
shards as the harness side, split by rank (shards ``i % world == rank``, in order), through a
``DataLoader(batch_size=micro, num_workers=0)`` over an ``IterableDataset``: what a user
writes by hand, and which cannot resume mid-epoch or at another world size.

    python -m torch.distributed.run --standalone --nproc-per-node N \
        elastic_harness/bench/tput_stream_plain.py --side plain --shards S.json --out O ...
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from elastic_harness.bench.tput_stream import decoder, script_parser


def plain_main(args: argparse.Namespace) -> None:
    import contextlib

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, IterableDataset

    from elastic_harness.bench.tput_common import StepClock, build_model, build_optimizer
    from elastic_harness.data.adapters import tar_stream

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shards = json.loads(Path(args.shards).read_text())

    reader = tar_stream(shards)  # the same tar parsing as the harness side, nothing else
    decode = decoder(args.data)  # and the same decoding (costly: JPEG decode + augmentation)

    class RankShards(IterableDataset):
        def __iter__(self):
            while True:  # epochs, the rank's shards in order
                for path in shards[rank::world]:
                    for sample in reader.open(path):
                        yield decode(sample)

    model = DDP(build_model(args.hidden))
    optimizer = build_optimizer(model)
    batches = iter(DataLoader(RankShards(), batch_size=args.micro_batch, num_workers=0))
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
    dist.destroy_process_group()


if __name__ == "__main__":
    plain_main(script_parser().parse_args())
