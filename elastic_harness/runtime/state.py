"""What a checkpoint holds, as DCP ``Stateful`` objects.

``model`` and ``optim`` go through torch's ``get_*_state_dict``/``set_*_state_dict``, which
give world-size-independent names (no ``module.`` prefix) and DTensor shards under FSDP2,
so DCP can reshard them to any world size. ``train`` is world-size-free by construction:
step, the data stream cursor, the seed and dataset size it refers to, and (for reporting
only) the world size it was saved at. Per-step randomness is derived from (seed, step,
rank), and the LR from the step, so neither needs saving.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from elastic_harness.data.sampler import STATE_VERSION, DataState


class ModelState(Stateful):
    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict:
        return get_model_state_dict(self.model)

    def load_state_dict(self, sd: dict) -> None:
        set_model_state_dict(self.model, sd)


class OptimState(Stateful):
    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.model, self.optim)

    def load_state_dict(self, sd: dict) -> None:
        set_optimizer_state_dict(self.model, self.optim, sd)


class TrainState(Stateful):
    """Step and data position; plain int64 tensors so nothing is pickled."""

    FIELDS = ("version", "step", "cursor", "seed", "dataset_size", "world_size")

    def __init__(self, data: DataState, world_size: int, step: int = 0) -> None:
        self.step = step
        self.data = data
        self.world_size = world_size
        self.saved_world_size: int | None = None

    def state_dict(self) -> dict:
        values = {
            "version": self.data.version,
            "step": self.step,
            "cursor": self.data.cursor,
            "seed": self.data.seed,
            "dataset_size": self.data.dataset_size,
            "world_size": self.world_size,
        }
        return {k: torch.tensor(v, dtype=torch.int64) for k, v in values.items()}

    def load_state_dict(self, sd: dict) -> None:
        v = {k: int(sd[k]) for k in self.FIELDS}
        self.step = v["step"]
        self.saved_world_size = v["world_size"]
        self.data = DataState(v["seed"], v["dataset_size"], v["cursor"], v["version"])

    def check_matches(self, seed: int, dataset_size: int) -> str | None:
        """A reason this saved position cannot continue this job's stream, or None."""
        d = self.data
        if d.version != STATE_VERSION:
            return f"data state version {d.version}, this harness reads {STATE_VERSION}"
        if d.seed != seed:
            return f"saved with train.seed={d.seed}, the job now says {seed}"
        if d.dataset_size != dataset_size:
            return f"saved with a dataset of {d.dataset_size} samples, it now has {dataset_size}"
        return None
