"""Tasks used by tests (importable as ``tests.tasks:NAME``)."""

import torch

from elastic_harness.tasks.mlp import MLPRegression


class OtherMLP(MLPRegression):
    """The same shapes as MLPRegression under another name: refused by task identity."""


class Poisoned(MLPRegression):
    """One sample cannot be loaded (a deterministic bug): every attempt fails at its step."""

    def __init__(self, poison: int = 100, **kw):
        super().__init__(**kw)
        self.poison = poison

    def dataset(self):
        inner = super().dataset()
        poison = self.poison

        class WithPoison(torch.utils.data.Dataset):
            def __len__(self):
                return len(inner)

            def __getitem__(self, i):
                if i == poison:
                    raise ValueError(f"sample {i} is corrupt")
                return inner[i]

        return WithPoison()


class BrokenModel(MLPRegression):
    """build_model raises: refused once by the host, before any worker starts."""

    def build_model(self):
        raise ValueError("hidden size must be even, got 7")
