"""A user's BatchNorm CNN on a ``TensorDataset`` of images and class labels: each item is
``(image, label)`` with a 0-dim int64 label, the shape that crash-looped
``train.record_samples`` (issue 33). Conv layers keep their bias before BatchNorm, as
many hand-written models do (docs/tolerance.md says what that does on a resize).

    elastic-harness run --set train.record_samples=true tests/scripts/bn_cnn.py [--no-conv-bias]
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset

import elastic_harness as eh

SAMPLES, CLASSES, SIZE = 240, 4, 12


def images() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    labels = torch.randint(0, CLASSES, (SAMPLES,), generator=g)
    x = torch.randn(SAMPLES, 1, SIZE, SIZE, generator=g)
    x[torch.arange(SAMPLES), 0, labels * 3, :] += 2.0  # a bright row per class
    return TensorDataset(x, labels)


def model(conv_bias: bool = True) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1, bias=conv_bias), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1, bias=conv_bias), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, CLASSES),
    )


def main() -> None:
    run = eh.init(None, argv=sys.argv[1:], overrides=[
        "train.steps=20", "train.global_batch_size=24", "train.micro_batch_size=4",
        "checkpoint.every_steps=5"])
    net = DDP(model(conv_bias="--no-conv-bias" not in run.argv).to(run.device), device_ids=run.device_ids)
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    run.register(net, optimizer)
    for step in run.steps(images()):
        for x, y in step.batches():
            step.backward(F.cross_entropy(net(x), y, reduction="none"))
        optimizer.step()
        optimizer.zero_grad()
        step.done()
    run.close()


if __name__ == "__main__":
    main()
