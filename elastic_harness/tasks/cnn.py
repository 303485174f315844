"""A small CNN with BatchNorm on synthetic images: a task that brings its own optimizer,
LR scheduler and evaluation, and whose model carries buffers (BatchNorm's running
statistics and its 0-dim int64 ``num_batches_tracked``).

Images are 1 x ``size`` x ``size``: class ``c`` of ``classes`` is a bright bar at a
class-specific orientation and offset, plus noise, generated from ``data_seed`` (no
downloads). ``augment`` flips images at random in ``__getitem__``: per-item randomness that
the harness seeds from the sample's stream position.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class BarImages(torch.utils.data.Dataset):
    def __init__(self, samples: int, size: int, classes: int, seed: int, augment: bool) -> None:
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, classes, (samples,), generator=g)
        coords = torch.linspace(-1, 1, size)
        yy, xx = torch.meshgrid(coords, coords, indexing="ij")
        angles = self.labels.float() * math.pi / classes
        dist = (xx * torch.cos(angles)[:, None, None] + yy * torch.sin(angles)[:, None, None]).abs()
        self.images = (dist < 0.25).float().unsqueeze(1) + 0.3 * torch.randn(samples, 1, size, size, generator=g)
        self.augment = augment

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[i]
        if self.augment and torch.rand(()) < 0.5:
            image = image.flip(-1).flip(-2)  # a 180-degree turn keeps the class
        return image, self.labels[i]


class SmallCNN(nn.Module):
    def __init__(self, classes: int, width: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class BarCNN:
    """Classify bar orientations; AdamW without decay on norms/biases, warm-up + cosine LR."""

    def __init__(self, samples: int = 1024, eval_samples: int = 256, size: int = 16,
                 classes: int = 4, width: int = 8, lr: float = 0.01, weight_decay: float = 0.05,
                 warmup: int = 5, total_steps: int = 100, augment: bool = True,
                 data_seed: int = 7) -> None:
        self.samples, self.eval_samples, self.size, self.classes = samples, eval_samples, size, classes
        self.width, self.lr, self.weight_decay = width, lr, weight_decay
        self.warmup, self.total_steps, self.augment, self.data_seed = warmup, total_steps, augment, data_seed

    def build_model(self) -> nn.Module:
        return SmallCNN(self.classes, self.width)

    def dataset(self) -> BarImages:
        return BarImages(self.samples, self.size, self.classes, self.data_seed, self.augment)

    def eval_dataset(self) -> BarImages:
        return BarImages(self.eval_samples, self.size, self.classes, self.data_seed + 1, False)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y, reduction="none")

    def evaluate(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        x, y = batch
        logits = model(x)
        return {"loss": F.cross_entropy(logits, y, reduction="none"),
                "accuracy": (logits.argmax(dim=1) == y).float()}

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """Two parameter groups: no weight decay on norms and biases (1-dim parameters)."""
        decay = [p for p in model.parameters() if p.ndim > 1]
        no_decay = [p for p in model.parameters() if p.ndim <= 1]
        return torch.optim.AdamW([{"params": decay, "weight_decay": self.weight_decay},
                                  {"params": no_decay, "weight_decay": 0.0}], lr=self.lr)

    def lr_scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        warm = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=self.warmup)
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, self.total_steps - self.warmup))
        return torch.optim.lr_scheduler.SequentialLR(optimizer, [warm, cosine], milestones=[self.warmup])
