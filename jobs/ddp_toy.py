"""The DDP checkpointing toy (seed 000) converted to elastic_harness: the "after" of
jobs/ddp_toy_plain.py. The model, loss and optimizer are unchanged; the harness now owns
the process group, the data order, checkpoints and resumption.

    torchrun --nproc-per-node 2 --max-restarts 3 jobs/ddp_toy.py     # plain torchrun
    elastic-harness run jobs/ddp_toy.yaml                            # or through the harness

Either way a crash resumes from the newest verified checkpoint, at any number of
processes, with the same global batch and no sample repeated or skipped.
"""

import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset

import elastic_harness as eh


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def toy_data(samples=2000):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 10, generator=g)
    return TensorDataset(x, torch.tanh(x[:, :5] - x[:, 5:]))


def main():
    run = eh.init(Path(__file__).with_suffix(".yaml"), argv=sys.argv[1:])
    model = ToyModel().to(run.device)
    ddp_model = DDP(model, device_ids=run.device_ids)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.05)
    run.register(ddp_model, optimizer)
    for step in run.steps(toy_data()):
        for x, y in step.batches():
            step.backward(loss_fn(ddp_model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        step.done()
    run.close()


if __name__ == "__main__":
    main()
