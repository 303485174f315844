"""A tiny script of one's own that makes one API mistake, named by --mistake (tests)."""

import argparse
import sys

import torch
from torch import nn

import elastic_harness as eh

run = eh.init(None, argv=sys.argv[1:], overrides=["train.steps=4", "train.global_batch_size=4",
                                                  "train.micro_batch_size=2"])
cli = argparse.ArgumentParser()
cli.add_argument("--mistake", default="none")
args = cli.parse_args(run.argv)
model = nn.Linear(3, 1)
if args.mistake != "unwrapped":  # on 2 ranks: each trains its own copy
    model = nn.parallel.DistributedDataParallel(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
if args.mistake == "unregistered-scheduler":
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 0.1, total_iters=2)
if args.mistake == "stray-optimizer":
    optimizer = torch.optim.SGD(nn.Linear(3, 1).parameters(), lr=0.1)
run.register(model, optimizer)
data = torch.utils.data.TensorDataset(torch.randn(16, 3), torch.randn(16, 1))
given = torch.utils.data.DataLoader(data, batch_size=2) if args.mistake == "dataloader" else data
for step in run.steps(given):
    for x, y in step.batches():
        loss = nn.functional.mse_loss(model(x), y)
        if args.mistake == "plain-backward":
            loss.backward()
        else:
            step.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    if args.mistake != "no-step-hook":
        step.done()
    if args.mistake == "bad-evaluate":
        run.evaluate(data, lambda batch: {"loss": 1 / 0})
run.close()
print("finished at step", run.step)
