"""Single-file model weights in and out of the harness (``ckpt export``/``import``).

Out: one plain ``{name: tensor}`` state dict on CPU with clean names, as ``.pt`` (loadable
with ``torch.load(..., weights_only=True)``) or ``.safetensors`` (written here from the
format's public description: an 8-byte little-endian header length, a JSON header with
dtype, shape and byte offsets per tensor, then the raw little-endian bytes).

In: a legacy single-file checkpoint (e.g. rank 0's ``torch.save`` of a DDP model, keys
prefixed ``module.``), always read with ``weights_only=True`` onto CPU, and written as a
DCP checkpoint by one process, with the same manifest as any other.
"""

from __future__ import annotations

import json
import struct
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from elastic_harness.checkpoint import integrity
from elastic_harness.checkpoint.storage import Storage
from elastic_harness.errors import CheckpointError

# Names wrappers insert into parameter names: DDP/DataParallel at the front, torch.compile,
# FSDP1 and activation checkpointing anywhere.
_LEADING = "module."
_ANYWHERE = ("_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
# Where legacy files usually keep the model: {'model': sd, 'optimizer': ...} and friends.
_MODEL_KEYS = ("model", "state_dict", "model_state_dict", "module")

_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def clean_name(name: str) -> str:
    while name.startswith(_LEADING):
        name = name[len(_LEADING):]
    for part in _ANYWHERE:
        name = name.replace(part, "")
    return name


def clean_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        new = clean_name(name)
        if new in out:
            raise CheckpointError(f"two tensors map to the name '{new}' once wrapper prefixes are removed")
        out[new] = t
    return out


def save_model_file(tensors: dict[str, torch.Tensor], path: Path) -> int:
    """Write ``tensors`` (clean names, CPU) to ``.pt``/``.pth`` or ``.safetensors``; returns bytes."""
    plain = {k: v.detach().to("cpu").contiguous() for k, v in clean_names(tensors).items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".safetensors":
        _write_safetensors(plain, path)
    elif path.suffix in (".pt", ".pth"):
        torch.save(plain, path)
    else:
        raise CheckpointError(f"cannot tell the format of '{path.name}'", "name it *.pt or *.safetensors")
    return path.stat().st_size


def _write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset, blobs = 0, []
    for name in sorted(tensors):
        t = tensors[name]
        if t.dtype not in _ST_DTYPES:
            raise CheckpointError(f"tensor '{name}' has dtype {t.dtype}, which .safetensors export does not support", "export to .pt")
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # align the data section to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for data in blobs:
            f.write(data)


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    base, out = 8 + n, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        raw = bytearray(blob[base + begin:base + end])
        flat = torch.frombuffer(raw, dtype=_ST_NAMES[info["dtype"]]) if raw else torch.empty(0, dtype=_ST_NAMES[info["dtype"]])
        out[name] = flat.reshape(info["shape"])
    return out


def load_model_file(path: Path) -> dict[str, torch.Tensor]:
    """A single-file model (.safetensors, or torch.save output read with weights_only=True).

    Accepts a bare state dict or one nested under a usual key (``model``, ``state_dict``,
    ...); returns clean names on CPU. Never unpickles arbitrary objects.
    """
    if path.suffix == ".safetensors":
        return clean_names(_read_safetensors(path))
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # weights_only refuses pickled code; say so plainly
        raise CheckpointError(
            f"'{path}' cannot be read as plain tensors (weights_only=True): {e}".splitlines()[0][:400],
            "export only the model's state_dict (tensors, dicts, numbers) to that file",
        ) from None
    sd = _find_state_dict(obj)
    if sd is None:
        raise CheckpointError(f"'{path}' holds no model state dict (no dict of tensors found)",
                              "save model.state_dict(), or a dict with it under 'model'")
    return clean_names(sd)


def _find_state_dict(obj: Any) -> dict[str, torch.Tensor] | None:
    if isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return obj
    if isinstance(obj, dict):
        for key in _MODEL_KEYS:
            if key in obj and (found := _find_state_dict(obj[key])) is not None:
                return found
    return None


def save_single_process(storage: Storage, name: str, state: dict[str, Any], info: dict) -> dict:
    """Write ``state`` as step directory ``name`` from this one process, then commit it."""
    if name in storage.listing():
        raise CheckpointError(f"{storage.uri(name)} already exists", "import into a new run dir")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.save(state, storage_writer=storage.writer(name), no_dist=True)
    return integrity.write_manifest(storage, name, info)
