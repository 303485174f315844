"""A fingerprint of a model's full state: equal exactly when the tensors are equal."""

from __future__ import annotations

import hashlib
import pickle

import torch
from torch import nn


def model_digest(model: nn.Module) -> str:
    """sha256 over every entry of the full model state dict (names, dtypes, shapes, bytes).

    Collective under FSDP (the full state is gathered); every rank computes it, rank 0's
    is the one reported. Any dtype and shape hashes: 0-dim integer buffers (BatchNorm's
    ``num_batches_tracked``), bf16 parameters, bools; a non-tensor entry hashes its pickle.
    Tied weights appear under each of their names.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    h = hashlib.sha256()
    for name in sorted(sd):
        h.update(tensor_bytes(name, sd[name]))
    return h.hexdigest()


def tensor_bytes(name: str, value: object) -> bytes:
    if not isinstance(value, torch.Tensor):
        return f"{name}|object|".encode() + pickle.dumps(value)
    t = value.detach().cpu().contiguous().reshape(-1)
    header = f"{name}|{value.dtype}|{tuple(value.shape)}|".encode()
    return header + (t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
