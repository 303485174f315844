"""A script whose rank 1 goes on working after run.close() (tests of the exit wait):
it writes MARKER after --linger seconds, then sleeps until it is stopped."""

import argparse
import os
import sys
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import elastic_harness as eh

run = eh.init(None, argv=sys.argv[1:])
cli = argparse.ArgumentParser()
cli.add_argument("--linger", type=float, default=0.0)
cli.add_argument("--marker", default="")
args = cli.parse_args(run.argv)
model = DDP(nn.Linear(3, 1))  # two ranks: wrapped, or the harness stops it (registration)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
run.register(model, optimizer)
data = torch.utils.data.TensorDataset(torch.randn(16, 3), torch.randn(16, 1))
for step in run.steps(data):
    for x, y in step.batches():
        step.backward(nn.functional.mse_loss(model(x), y))
    optimizer.step()
    optimizer.zero_grad()
    step.done()
rank = run.rank
run.close()
if rank == 1 and args.linger:
    time.sleep(args.linger)  # work after close, e.g. writing an export
    with open(args.marker, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(3600)  # then hangs: cut short
