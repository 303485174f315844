"""Your own training script on a *stream*: tokenized shards read in order, packed into
fixed-length sequences, resumed exactly after a kill or a resize (docs/streaming.md).

    elastic-harness run jobs/stream_script.yaml                 # jsonl shards
    elastic-harness run jobs/stream_script.yaml --set 'script.args=[--format, tar]'

The corpus (tokenized stdlib sources, see elastic_harness/tasks/streamlm.py) is built on
first use in RUN_DIR/corpus (or --data-dir, a directory or an s3:// URL). The stream is a
list of shards and a reader; ``run.steps(stream)`` does the rest.
"""

import argparse
import sys

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import elastic_harness as eh
from elastic_harness.data import Packing, jsonl_stream, parquet_stream, tar_stream
from elastic_harness.tasks.charlm import TinyGPT
from elastic_harness.tasks.streamlm import build_corpus, ids_of

READERS = {"jsonl": jsonl_stream, "tar": tar_stream, "parquet": parquet_stream}


def main():
    run = eh.init(argv=sys.argv[1:])
    cli = argparse.ArgumentParser()
    cli.add_argument("--format", choices=sorted(READERS), default="jsonl")
    cli.add_argument("--data-dir", default=str(run.run_dir / "corpus"))
    cli.add_argument("--shards", type=int, default=6)
    cli.add_argument("--max-docs", type=int, default=200)
    cli.add_argument("--block-size", type=int, default=32)
    cli.add_argument("--lanes", type=int, default=None)
    args = cli.parse_args(run.argv)

    shards = build_corpus(args.data_dir, args.shards, args.max_docs, args.format)
    stream = READERS[args.format](shards, pack=Packing(args.block_size + 1, ids_of), lanes=args.lanes)

    model = DDP(TinyGPT(args.block_size, 32, 1, 2, 0.0).to(run.device), device_ids=run.device_ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    run.register(model, optimizer)
    for step in run.steps(stream, collate_fn=lambda seqs: torch.stack([torch.as_tensor(s) for s in seqs])):
        for batch in step.batches():
            x, y = batch[:, :-1], batch[:, 1:]
            loss = F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
            step.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        step.done()
    run.close()


if __name__ == "__main__":
    main()
