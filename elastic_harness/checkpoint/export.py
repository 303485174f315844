"""Single-file model weights in and out of the harness (``ckpt export``/``import``).

Out: one plain ``{name: tensor}`` state dict on CPU with clean names, as ``.pt`` (loadable
with ``torch.load(..., weights_only=True)``) or ``.safetensors`` (through the ``safetensors``
library, which also checks a file's header against its size when reading).

In: a legacy single-file checkpoint (e.g. rank 0's ``torch.save`` of a DDP model, keys
prefixed ``module.``), always read with ``weights_only=True`` onto CPU, or a ``.safetensors``
file, and written as a DCP checkpoint by one process, with the same manifest as any other.
A file that is missing, truncated or not in the format its name says is a ``CheckpointError``.
"""

from __future__ import annotations

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
        from safetensors.torch import save_file

        save_file(_unshared(plain), str(path), metadata={"format": "pt"})
    elif path.suffix in (".pt", ".pth"):
        torch.save(plain, path)
    else:
        raise CheckpointError(f"cannot tell the format of '{path.name}'", "name it *.pt or *.safetensors")
    return path.stat().st_size


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies of tensors that share memory with an earlier one (tied weights): the
    ``safetensors`` writer refuses shared memory, and each name gets its own bytes anyway."""
    seen: set[int] = set()
    out = {}
    for name, t in tensors.items():
        ptr = t.untyped_storage().data_ptr() if t.numel() else 0
        out[name] = t.clone() if ptr and ptr in seen else t
        seen.add(ptr)
    return out


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device="cpu")
    except SafetensorError as e:
        raise CheckpointError(f"'{path}' is not a readable .safetensors file ({e})",
                              "it may be truncated or corrupt: export or copy it again") from None


def load_model_file(path: Path) -> dict[str, torch.Tensor]:
    """A single-file model (.safetensors, or torch.save output read with weights_only=True).

    Accepts a bare state dict or one nested under a usual key (``model``, ``state_dict``,
    ...); returns clean names on CPU. Never unpickles arbitrary objects.
    """
    _check_readable(path)
    if path.suffix == ".safetensors":
        return clean_names(_read_safetensors(path))
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch's messages run to paragraphs: one line, and the right fix
        raise CheckpointError(*explain_load_failure(str(path), str(e))) from None
    sd = _find_state_dict(obj)
    if sd is None:
        raise CheckpointError(f"'{path}' holds no model state dict (no dict of tensors found)",
                              "save model.state_dict(), or a dict with it under 'model'")
    return clean_names(sd)


def explain_load_failure(path: str, detail: str) -> tuple[str, str]:
    """Pure: (message, fix) for a ``torch.load(weights_only=True)`` failure. Pickled code
    (a class, a function) is refused by design; anything else is a damaged or foreign file."""
    marker = "WeightsUnpickler error:"
    rest = detail.split(marker, 1)[1] if marker in detail else detail
    lines = [line.strip() for line in rest.splitlines() if line.strip()] or [""]
    if "Unsupported global" in detail:
        what = lines[0].split("Unsupported global:", 1)[-1].split(" was not", 1)[0].strip()
        return (f"'{path}' holds pickled objects, which weights_only=True refuses ({what})",
                "save only the model's state_dict (tensors, dicts, numbers) to that file")
    reason = lines[0].split(". ")[0][:200]
    return (f"'{path}' is not a readable torch.save file ({reason})",
            "it may be truncated or corrupt: save or copy it again")


def _check_readable(path: Path) -> None:
    """A missing file or a directory is a wrong path, not a wrong format: say so."""
    if path.is_dir():
        raise CheckpointError(f"'{path}' is a directory, not a single-file checkpoint",
                              "name a .pt/.pth or .safetensors file (a run's checkpoints need no import)")
    if not path.exists():
        raise CheckpointError(f"'{path}' does not exist", "check the path to the file")


def _find_state_dict(obj: Any) -> dict[str, torch.Tensor] | None:
    if isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return obj
    if isinstance(obj, dict):
        for key in _MODEL_KEYS:
            if key in obj and (found := _find_state_dict(obj[key])) is not None:
                return found
    return None


def save_single_process(storage: Storage, name: str, state: dict[str, Any], info: dict,
                        key: bytes | None = None) -> dict:
    """Write ``state`` as step directory ``name`` from this one process, then commit it."""
    if name in storage.listing():
        raise CheckpointError(f"{storage.uri(name)} already exists", "import into a new run dir")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.save(state, storage_writer=storage.writer(name), no_dist=True)
    return integrity.write_manifest(storage, name, info, key=key)  # signed with the job's key
