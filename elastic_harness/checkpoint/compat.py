"""Refuse a checkpoint that belongs to another model or job, before loading anything.

DCP's default load planner raises on missing keys but silently ignores *extra* keys in a
checkpoint, so a checkpoint of a bigger model would load "fine" into a smaller one. We
compare, from ``.metadata`` alone (no shard is read): the top-level entries (a job that now
registers a scheduler or a GradScaler the checkpoint lacks, or the reverse), and the keys
and shapes of the model's tensors and the optimizer's per-parameter state.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from elastic_harness.checkpoint.entries import STRICT_PREFIXES, top_level
from elastic_harness.errors import CheckpointError

_FIX = "it belongs to another model or config: use a new --run-dir or --fresh"


def flat_shapes(state: dict[str, Any]) -> dict[str, tuple[int, ...] | None]:
    """``{dotted key: global shape}`` as DCP flattens it (None for non-tensors)."""
    from elastic_harness.checkpoint.plans import flatten

    plain = {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state.items()}
    flat = flatten(plain)
    return {k: tuple(v.shape) if hasattr(v, "shape") else None for k, v in flat.items()}


def check_compatible(reader: Any, state: dict[str, Any], manifest: dict, info: dict) -> None:
    """Raise ``CheckpointError`` if the checkpoint's entries/keys/shapes/task differ from ``state``."""
    where = getattr(reader, "path", "checkpoint")
    task = manifest.get("task")
    if task and info.get("task") and task != info["task"]:
        raise CheckpointError(
            f"{where} was written by task '{task}', this job trains '{info['task']}'",
            "use a new --run-dir (or --fresh) for a different task",
        )
    saved = reader.read_metadata().state_dict_metadata
    want = flat_shapes(state)
    _check_entries(where, {top_level(k) for k in saved}, set(state))
    saved_keys = {k for k in saved if k.startswith(STRICT_PREFIXES)}
    want_keys = {k for k in want if k.startswith(STRICT_PREFIXES)}
    missing, extra = sorted(want_keys - saved_keys), sorted(saved_keys - want_keys)
    bad_shape = [
        f"{k}: saved {tuple(saved[k].size)}, model {want[k]}"
        for k in sorted(saved_keys & want_keys)
        if isinstance(saved[k], TensorStorageMetadata) and tuple(saved[k].size) != want[k]
    ]
    if missing or extra or bad_shape:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} keys (e.g. {missing[:3]})")
        if extra:
            parts.append(f"{len(extra)} unexpected keys (e.g. {extra[:3]})")
        if bad_shape:
            parts.append(f"{len(bad_shape)} shape mismatches (e.g. {bad_shape[:2]})")
        raise CheckpointError(f"{where} does not match this model/optimizer: " + "; ".join(parts), _FIX)


def _check_entries(where: str, saved: set[str], wanted: set[str]) -> None:
    """The checkpoint must hold exactly the entries this job registers (scheduler, scaler...)."""
    lacking, surplus = sorted(wanted - saved), sorted(saved - wanted)
    if not lacking and not surplus:
        return
    parts = []
    if lacking:
        parts.append(f"has no {', '.join(lacking)} state that this job now registers")
    if surplus:
        parts.append(f"holds {', '.join(surplus)} state that this job no longer registers")
    raise CheckpointError(
        f"{where} {' and '.join(parts)} (scheduler, precision or registered objects changed?)",
        "keep the job's scheduler/precision/registered objects as they were, or start over "
        "with a new --run-dir or --fresh",
    )
