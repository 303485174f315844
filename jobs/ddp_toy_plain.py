"""The DDP checkpointing toy that users start from (PyTorch's DDP tutorial, seed 000),
as a plain torchrun training script: the "before" of jobs/ddp_toy.py.

    torchrun --nproc-per-node 2 jobs/ddp_toy_plain.py

Rank 0 saves the model with torch.save once per epoch. A crash loses the epoch, a restart
starts over from step 0, and resuming on another number of processes would need the
sampler's state rebuilt by hand.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


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
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = ToyModel()
    ddp_model = DDP(model)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.05)
    data = toy_data()
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=20, sampler=sampler)
    for epoch in range(4):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss_fn(ddp_model(x), y).backward()
            optimizer.step()
        if dist.get_rank() == 0:
            torch.save(ddp_model.module.state_dict(), "toy.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
