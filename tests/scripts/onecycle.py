"""A script with an LR schedule over ``run.spec.train.steps`` (tests): ``--schedule onecycle``
is the OneCycleLR pattern, whose saved state keeps its total; ``--schedule lambda`` the
LambdaLR pattern docs/script-api.md recommends when ``train.steps`` may grow on a resume."""

import argparse
import math
import sys

import torch
from torch import nn

import elastic_harness as eh

run = eh.init(None, argv=sys.argv[1:])
cli = argparse.ArgumentParser()
cli.add_argument("--schedule", choices=["onecycle", "lambda"], default="onecycle")
args = cli.parse_args(run.argv)
model = nn.parallel.DistributedDataParallel(nn.Linear(3, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
if args.schedule == "onecycle":
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.1, total_steps=run.spec.train.steps)
else:
    def cosine(done: int) -> float:  # reads train.steps when called: the new total after a resume
        return 0.5 * (1 + math.cos(math.pi * min(done, run.spec.train.steps) / run.spec.train.steps))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine)
run.register(model, optimizer, scheduler=scheduler)
data = torch.utils.data.TensorDataset(torch.randn(64, 3), torch.randn(64, 1))
for step in run.steps(data):
    for x, y in step.batches():
        step.backward(nn.functional.mse_loss(model(x), y))
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    step.done()
run.close()
