"""A script that loops over ``run.steps()`` more than once, as named by its argument (tests):
``twice`` (a second loop after the job's last step), ``break`` (leave at step 4, then loop
again), ``break-only`` (leave at step 4 and close), ``nested`` (a loop inside a loop body)."""

import sys

import torch
from torch import nn

import elastic_harness as eh

run = eh.init(None, argv=sys.argv[1:])
mode = run.argv[0]
model = nn.parallel.DistributedDataParallel(nn.Linear(3, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
run.register(model, optimizer)
data = torch.utils.data.TensorDataset(torch.randn(64, 3), torch.randn(64, 1))


def loop(stop=None):
    for step in run.steps(data):
        for x, y in step.batches():
            step.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        step.done()
        if step.number == stop:
            break
    print("left the loop at step", run.step, flush=True)


if mode == "twice":
    loop()
    loop()
elif mode == "break":
    loop(stop=4)
    loop()
elif mode == "break-only":
    loop(stop=4)
elif mode == "nested":
    for _step in run.steps(data):
        for _inner in run.steps(data):
            pass
run.close()
