"""A tiny task over a sharded stream (tests only): ``shards`` in-memory shards (2) of 4-feature rows,
sized by their lengths, so nothing is read to build or size it."""

from __future__ import annotations

import torch
from torch import nn

from elastic_harness.data.stream import Stream

ROWS = 12


def _shard(index: int):
    g = torch.Generator().manual_seed(index)
    return list(torch.randn(ROWS, 5, generator=g))


class TinyStream:
    def __init__(self, shards: int = 2) -> None:
        self.shards = shards

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def dataset(self) -> Stream:
        return Stream(list(range(self.shards)), _shard, lengths=[ROWS] * self.shards, lanes=4)

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return (model(batch[:, :4]).squeeze(1) - batch[:, 4]) ** 2
