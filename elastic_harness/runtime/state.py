"""What a checkpoint holds: named entries, built in one place (``build_state``).

Every entry is a DCP ``Stateful`` (or a plain dict DCP loads in place), keyed by the names
in ``checkpoint.entries``; the checkpoint compatibility check, ``ckpt import`` and the worker all build the
state through ``build_state`` so the key sets cannot drift apart.

- ``model`` / ``optim`` go through torch's ``get_*_state_dict``/``set_*_state_dict``:
  world-size-independent names (no ``module.``/``_orig_mod.`` prefixes) and DTensor shards
  under FSDP2, so DCP can reshard them to any world size. The names torch gives are kept from
  its first answer and applied to the module's and optimizer's own state dicts while their
  structure stays the same (``statenames``: torch's answer exactly, checked when kept), so
  a save does not walk the model again on the training thread. Buffers (BatchNorm's running
  statistics and its 0-dim int64 ``num_batches_tracked``) are part of ``model``;
  non-persistent buffers are not (the model recomputes them).
- ``train`` is world-size-free by construction: step, the data stream cursor, the seed and
  dataset size (samples per epoch) it refers to, for a sharded stream digests of its shard
  list and of what fixes its order (lanes, window, packing, shard sizes; 0 for map-style
  data: the cursor alone then names every lane's shard and offset, ``data.order``), and
  (for reporting only) the world size it was saved at: the process count, the events'
  ``world_size``. The position itself names no degree or rank: each data-parallel rank
  derives its share of a step from it (``data.sampler``, ``runtime.topology``).
- ``sched`` and ``scaler`` are the LR scheduler's and GradScaler's own ``state_dict()``
  (plain values, pickled by DCP); ``extra.NAME`` anything else a script registers.

Per-step randomness is derived from (seed, step, rank), so no RNG state is saved.

The in-memory tier (``memtier``) restores only into the same tensor layout (the same world
size, or under DDP any world size: a replica's module and optimizer state dicts do not
depend on it), so for
``model`` and ``optim`` it uses the module's and optimizer's own state dicts instead
(``local_state_dict``, ``local_target``, ``load_local_state_dict``): the same tensors without
the name mapping of ``get_*_state_dict``, which costs 50-200x more per call and would be paid
at every snapshot.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from elastic_harness.checkpoint.entries import EXTRA_PREFIX, MODEL, OPTIM, SCALER, SCHED, TRAIN
from elastic_harness.data.sampler import STATE_VERSION, DataState
from elastic_harness.runtime import statenames


class ModelState(Stateful):
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._names: tuple[tuple, list | None] | None = None  # (model_key, torch's names or None)

    def state_dict(self) -> dict:
        """``get_model_state_dict``'s answer; from the module's own state dict renamed with the
        names torch gave the last time, while the module's keys are the same (``statenames``)."""
        own = self.model.state_dict()
        key = statenames.model_key(own)
        if self._names is not None and self._names[0] == key and self._names[1] is not None:
            return statenames.named_model(own, self._names[1])
        full = get_model_state_dict(self.model)
        if self._names is None or self._names[0] != key:
            self._names = (key, statenames.model_names(own, full))
        return full

    def load_state_dict(self, sd: dict) -> None:
        set_model_state_dict(self.model, sd)

    def local_state_dict(self) -> dict:
        """The parameters themselves (``keep_vars``), not detached copies: a snapshot only
        reads them, and detaching a DTensor parameter (FSDP2) goes through its dispatch,
        ~50 us each at every snapshot."""
        return self.model.state_dict(keep_vars=True)

    def local_target(self) -> dict:
        return self.model.state_dict()

    def load_local_state_dict(self, sd: dict) -> None:
        self.model.load_state_dict(sd)


class OptimState(Stateful):
    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim
        self._names: tuple[tuple, dict | None] | None = None  # (optim_key, torch's names or None)

    def state_dict(self) -> dict:
        """``get_optimizer_state_dict``'s answer; from the optimizer's own state dict renamed
        with the names torch gave the last time, while its parameters and the model's names are
        the same (``statenames``). An optimizer without state yet goes to torch, which makes it."""
        key = statenames.optim_key(self.model, self.optim)
        if self.optim.state and self._names is not None and self._names[0] == key and self._names[1] is not None:
            return statenames.named_optim(self.optim.state_dict(), self._names[1])
        full = get_optimizer_state_dict(self.model, self.optim)
        if self._names is None or self._names[0] != key:
            self._names = (key, statenames.optim_names(self.optim.state_dict(), full))
        return full

    def load_state_dict(self, sd: dict) -> None:
        set_optimizer_state_dict(self.model, self.optim, sd)

    def local_state_dict(self) -> dict:
        return self.optim.state_dict()

    def local_target(self) -> dict:
        """A state dict to restore into: a fresh optimizer has no state tensors yet, so they
        are created first (``get_optimizer_state_dict`` does, with a zero step, as for a load)."""
        get_optimizer_state_dict(self.model, self.optim)
        return self.optim.state_dict()

    def load_local_state_dict(self, sd: dict) -> None:
        self.optim.load_state_dict(sd)


class ObjectState(Stateful):
    """Anything with ``state_dict()``/``load_state_dict()`` (schedulers, scalers, EMA, ...)."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> dict:
        return self.obj.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.obj.load_state_dict(sd)


class TrainState(Stateful):
    """Step and data position: plain int64 tensors for DCP, so nothing is pickled; ints for
    the in-memory tier, whose skeleton is pickled anyway."""

    # The saved keys. The order digest is saved as ``layout`` (its name when streams came):
    # every checkpoint of a stream holds it under that key, so the key stays.
    ORDER_DIGEST_KEY = "layout"
    FIELDS = ("version", "step", "cursor", "seed", "dataset_size", "world_size", "stream", ORDER_DIGEST_KEY)
    # Added with sharded streams: a checkpoint written before lacks them, and their default
    # (0: map-style data) is what it meant, so it still loads (``checkpoint.safe_load``).
    OPTIONAL_KEYS = frozenset({"train.stream", f"train.{ORDER_DIGEST_KEY}"})

    def __init__(self, data: DataState, world_size: int, step: int = 0) -> None:
        self.step = step
        self.data = data
        self.world_size = world_size
        self.saved_world_size: int | None = None
        self.stream = 0  # digest of a stream's shard list (0: map-style data)
        self.order_digest = 0  # digest of the stream's order settings and shard sizes (0: map-style data)

    def state_dict(self) -> dict:
        return {k: torch.scalar_tensor(v, dtype=torch.int64) for k, v in self.local_state_dict().items()}

    def local_state_dict(self) -> dict[str, int]:
        """The same values as plain ints, for the in-memory tier: they go into its pickled
        skeleton (no tensors to make, pickle and copy at every snapshot: ~40 us of ~230)."""
        return {
            "version": self.data.version,
            "step": self.step,
            "cursor": self.data.cursor,
            "seed": self.data.seed,
            "dataset_size": self.data.dataset_size,
            "world_size": self.world_size,
            "stream": self.stream,
            self.ORDER_DIGEST_KEY: self.order_digest,
        }

    def local_target(self) -> dict:
        return self.local_state_dict()

    def load_local_state_dict(self, sd: dict) -> None:
        self.load_state_dict(sd)

    def load_state_dict(self, sd: dict) -> None:
        """From tensors (DCP) or ints (the in-memory tier)."""
        v = {k: int(sd[k]) for k in self.FIELDS}
        self.step = v["step"]
        self.saved_world_size = v["world_size"]
        self.data = DataState(v["seed"], v["dataset_size"], v["cursor"], v["version"])
        self.stream, self.order_digest = v["stream"], v[self.ORDER_DIGEST_KEY]

    def check_matches(self, seed: int, dataset_size: int | None, stream: int = 0,
                      order_digest: int = 0) -> str | None:
        """A reason this saved position cannot continue this job's stream, or None
        (``dataset_size`` None: not known yet, checked once the data is bound)."""
        d = self.data
        if d.version != STATE_VERSION:
            return f"data state version {d.version}, this harness reads {STATE_VERSION}"
        if d.seed != seed:
            return f"saved with train.seed={d.seed}, the job now says {seed}"
        if dataset_size is None:
            return None
        if bool(self.stream) != bool(stream):
            return ("saved with a map-style dataset, the job now streams shards" if stream else
                    "saved with a sharded stream, the job now gives a map-style dataset")
        if self.stream != stream:
            return ("the stream's shard list changed since the checkpoint (shards added, removed, "
                    "renamed or reordered)")
        if self.order_digest != order_digest:
            return ("the stream's order changed since the checkpoint (its lanes, window, packing "
                    "or shuffle setting, or a shard's size)")
        if d.dataset_size != dataset_size:
            return f"saved with a dataset of {d.dataset_size} samples, it now has {dataset_size}"
        return None


def build_state(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    train: TrainState,
    *,
    scheduler: Any = None,
    scaler: Any = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The checkpointed state: one dict, the same keys wherever it is built."""
    state: dict[str, Any] = {MODEL: ModelState(model), OPTIM: OptimState(model, optim), TRAIN: train}
    if scheduler is not None:
        state[SCHED] = ObjectState(scheduler)
    if scaler is not None:
        state[SCALER] = ObjectState(scaler)
    for name, obj in (extra or {}).items():
        state[EXTRA_PREFIX + name] = obj if isinstance(obj, (Stateful, dict)) else ObjectState(obj)
    return state
