"""A toy DDP script with a pause: ``straggler.py RANK STEP SECONDS [phase]``.

After ``STEP``, global rank ``RANK`` (``all``: every rank) sleeps ``SECONDS``: a slow node
that is alive (its peers wait for it in the next collective), or, with ``phase``, work the
ranks announce (``run.phase``): steps legitimately stop there.
"""

import sys
import time

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset

import elastic_harness as eh


def main():
    run = eh.init()
    who, at, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    announced = sys.argv[4:] == ["phase"]
    model = DDP(nn.Linear(10, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    run.register(model, optimizer)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2000, 10, generator=g)
    for step in run.steps(TensorDataset(x, torch.tanh(x[:, :5] - x[:, 5:]))):
        for xb, yb in step.batches():
            step.backward(nn.functional.mse_loss(model(xb), yb))
        optimizer.step()
        optimizer.zero_grad()
        step.done()
        if run.step == at and who in ("all", str(run.rank)):
            if announced:
                with run.phase("a long pause of the script's own", seconds + 30):
                    time.sleep(seconds)
            else:
                time.sleep(seconds)
    run.close()


if __name__ == "__main__":
    main()
