"""Read a checkpoint's model in one process, without a process group (export, diff, verify).

Only the ``model.*`` tensors are read: tensors are allocated from ``.metadata`` (global
shapes and dtypes) and DCP fills them, resharding from however many ranks wrote them.
Everything lands on CPU, whatever device the saving ranks used.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

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
