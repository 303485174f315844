"""Checkpoints seen from one process, without a process group (``ckpt`` commands, tests).

Reading a model: only the ``model.*`` tensors are read; tensors are allocated from
``.metadata`` (global shapes and dtypes) and DCP fills them, resharding from however many
ranks wrote them. Everything lands on CPU, whatever device the saving ranks used.

Finding checkpoints: a user names a run directory, a checkpoint root, one step directory,
or an fsspec URL of either; ``locate`` turns that into a storage and an optional step.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from elastic_harness.checkpoint import integrity, layout
from elastic_harness.checkpoint.storage import Storage, open_storage
from elastic_harness.errors import CheckpointError

MODEL_PREFIX = "model."


def load_model_tensors(reader: Any) -> dict[str, torch.Tensor]:
    """``{parameter name: tensor}`` with clean names (no ``model.``/``module.`` prefixes)."""
    meta = reader.read_metadata().state_dict_metadata
    flat = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in meta.items()
        if k.startswith(MODEL_PREFIX) and isinstance(m, TensorStorageMetadata)
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load(flat, storage_reader=reader, no_dist=True)
    return {k[len(MODEL_PREFIX):]: v for k, v in flat.items()}


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict:
    """Max absolute and relative difference between two models; ``identical`` if bitwise equal."""
    if a.keys() != b.keys():
        return {"comparable": False, "only_a": sorted(a.keys() - b.keys()), "only_b": sorted(b.keys() - a.keys())}
    max_abs, max_rel, identical = 0.0, 0.0, True
    for k in a:
        x, y = a[k].double(), b[k].double()
        if x.shape != y.shape:
            return {"comparable": False, "shape_mismatch": k}
        identical = identical and torch.equal(a[k], b[k])
        d = (x - y).abs()
        max_abs = max(max_abs, float(d.max()) if d.numel() else 0.0)
        max_rel = max(max_rel, float((d / y.abs().clamp_min(1e-12)).max()) if d.numel() else 0.0)
    return {"comparable": True, "identical": identical, "max_abs": max_abs, "max_rel": max_rel}


@dataclass(frozen=True)
class Location:
    storage: Storage
    step: str | None = None  # one step directory the user named, else the whole root


def locate(target: str) -> Location:
    """A run dir (its ``checkpoints/``), a checkpoint root, or one step dir; path or URL."""
    if "://" in target and not target.startswith("file://"):
        head, _, last = target.rstrip("/").rpartition("/")
        if layout.parse_step(last) is not None:
            return Location(open_storage(head), last)
        return Location(open_storage(target))
    path = Path(target.removeprefix("file://"))
    if not path.is_dir():
        raise CheckpointError(f"'{target}' is not a directory", "name a run dir, a checkpoint dir or a step dir")
    if layout.parse_step(path.name) is not None:
        return Location(open_storage(str(path.parent)), path.name)
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    return Location(open_storage(str(path)))


def describe(storage: Storage, verify_mode: str) -> list[dict]:
    """One row per step directory, oldest first: step, world size, bytes, status."""
    rows = []
    for d in layout.scan(storage.listing(), require_manifest=True):
        manifest = integrity.read_manifest(storage, d.name) or {}
        row = {
            "step": d.step, "name": d.name, "world_size": manifest.get("world_size"),
            "bytes": sum(storage.files(d.name).values()), "complete": d.complete,
        }
        if d.complete:
            verdict = integrity.verify(storage, d.name, verify_mode)
            row["verified"] = verdict.ok if verify_mode != "none" else None
            row["problem"] = verdict.reason
        else:
            row["verified"], row["problem"] = False, "incomplete (interrupted save: .metadata or manifest missing)"
        rows.append(row)
    return rows


def pick(loc: Location, verify_mode: str = "full", step: int | None = None) -> str:
    """The step directory to read: the one named, ``step``, or the newest that verifies."""
    if loc.step is not None and step is None:
        names = [loc.step]
    else:
        dirs = layout.load_candidates(layout.scan(loc.storage.listing(), require_manifest=True))
        names = [d.name for d in dirs if step is None or d.step == step]
    reasons = []
    for name in names:
        verdict = integrity.verify(loc.storage, name, verify_mode)
        if verdict.ok:
            return name
        reasons.append(f"{name}: {verdict.reason}")
    which = f"step {step}" if step is not None else "a complete checkpoint"
    raise CheckpointError(
        f"no usable checkpoint in {loc.storage.root} ({which}); " + ("; ".join(reasons) or "none found"),
        "check the path, or run 'elastic-harness ckpt ls' on it",
    )
