"""A small MLP regression on a synthetic, seeded dataset (no downloads)."""

from __future__ import annotations

import torch
from torch import nn


class MLPRegression:
    """Learn ``y = sin(x @ w)`` plus noise; the data is generated from ``data_seed``."""

    def __init__(
        self, samples: int = 1024, dim: int = 16, hidden: int = 64, depth: int = 2, data_seed: int = 1234
    ) -> None:
        self.samples, self.dim, self.hidden, self.depth = samples, dim, hidden, depth
        self.data_seed = data_seed

    def build_model(self) -> nn.Module:
        layers: list[nn.Module] = []
        width = self.dim
        for _ in range(self.depth):
            layers += [nn.Linear(width, self.hidden), nn.Tanh()]
            width = self.hidden
        layers.append(nn.Linear(width, 1))
        return nn.Sequential(*layers)

    def dataset(self) -> torch.utils.data.TensorDataset:
        g = torch.Generator().manual_seed(self.data_seed)
        x = torch.randn(self.samples, self.dim, generator=g)
        w = torch.randn(self.dim, 1, generator=g) / self.dim**0.5
        y = torch.sin(3 * x @ w) + 0.05 * torch.randn(self.samples, 1, generator=g)
        return torch.utils.data.TensorDataset(x, y)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return ((model(x) - y) ** 2).mean(dim=1)
