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

import contextlib
import os
import warnings
from dataclasses import dataclass, field
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
_OPTIMIZER_KEYS = ("optimizer", "optimizer_state_dict", "optim", "opt")
_POSITION_KEYS = ("epoch", "step", "iteration", "global_step")

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
    """Write ``tensors`` (clean names, CPU) to ``.pt``/``.pth`` or ``.safetensors``; returns bytes.

    All or nothing: the file is written beside ``path`` under a temporary name and renamed
    over it when complete, so a failure (a read-only or full disk) leaves no partial file and
    an existing ``path`` as it was; directories made for it are removed again. A path that
    cannot be written is a ``CheckpointError`` naming it, checked before anything is written
    (``check_target``)."""
    plain = {k: v.detach().to("cpu").contiguous() for k, v in clean_names(tensors).items()}
    check_target(path)
    made = _make_parents(path)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file(_unshared(plain), str(tmp), metadata={"format": "pt"})
        else:
            torch.save(plain, tmp)
        os.replace(tmp, path)
    except Exception as e:  # noqa: BLE001 - OSError, torch's RuntimeError, SafetensorError: the same to the user
        tmp.unlink(missing_ok=True)
        for folder in reversed(made):
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise CheckpointError(f"cannot write '{path}': {_reason(e)}",
                              "pass --to a path in a directory you can write, with room for the model; "
                              "the checkpoint is untouched") from None
    return path.stat().st_size


def check_target(path: Path) -> None:
    """Refuse a destination that cannot work, before anything is read or written: an unknown
    suffix, a directory, a parent that is a file, not writable or on a read-only file system."""
    if path.suffix not in (".pt", ".pth", ".safetensors"):
        raise CheckpointError(f"cannot tell the format of '{path.name}'", "name it *.pt or *.safetensors")
    if path.is_dir():
        raise CheckpointError(f"'{path}' is a directory", "pass --to a file name, e.g. model.pt")
    existing = next(p for p in path.absolute().parents if p.exists())
    if not existing.is_dir():
        raise CheckpointError(f"cannot write '{path}': '{existing}' is not a directory",
                              "pass --to a path in a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CheckpointError(f"cannot write '{path}': '{existing}' is {_read_only(existing)}",
                              "pass --to a path in a directory you can write; the checkpoint is untouched")


def _make_parents(path: Path) -> list[Path]:
    """Create the missing parents of ``path``; returns them, outermost first."""
    made: list[Path] = []
    for folder in [p for p in path.absolute().parents if not p.exists()][::-1]:
        try:
            folder.mkdir()
        except OSError as e:
            for done in reversed(made):
                done.rmdir()
            raise CheckpointError(f"cannot create '{folder}': {e.strerror or e}",
                                  "pass --to a path in a directory you can write") from None
        made.append(folder)
    return made


def _read_only(folder: Path) -> str:
    """How to describe a directory this process cannot write."""
    try:
        return "on a read-only file system" if os.statvfs(folder).f_flag & os.ST_RDONLY else "not writable"
    except OSError:
        return "not writable"


def _reason(e: BaseException) -> str:
    """One line from an OSError, torch's writer (``... strerror: Read-only file system``) or
    the safetensors writer (``... I/O error: No space left on device (os error 28) ...``)."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    for marker in ("strerror: ", "I/O error: "):
        if marker in text:
            return text.split(marker, 1)[1].split(" (os error")[0].strip()
    return text[:200]


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
    return load_legacy_file(path).model


@dataclass
class Legacy:
    """What a legacy single-file checkpoint holds besides the model (``load_legacy_file``)."""

    model: dict[str, torch.Tensor]
    optimizer: dict | None = None  # torch's Optimizer.state_dict(), when the file has one
    position: dict[str, int] = field(default_factory=dict)  # e.g. {'epoch': 3}, as the file says


def load_legacy_file(path: Path) -> Legacy:
    """``load_model_file``, plus the optimizer's state dict (under ``optimizer``, ``optim``,
    ...) and the integers ``epoch``/``step``/``iteration`` a training script saved beside them."""
    _check_readable(path)
    if path.suffix == ".safetensors":
        return Legacy(clean_names(_read_safetensors(path)))
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch's messages run to paragraphs: one line, and the right fix
        raise CheckpointError(*explain_load_failure(str(path), str(e))) from None
    sd = _find_state_dict(obj)
    if sd is None:
        raise CheckpointError(f"'{path}' holds no model state dict (no dict of tensors found)",
                              "save model.state_dict(), or a dict with it under 'model'")
    if not isinstance(obj, dict):
        return Legacy(clean_names(sd))
    optim = next((obj[k] for k in _OPTIMIZER_KEYS if isinstance(obj.get(k), dict)), None)
    position = {k: int(obj[k]) for k in _POSITION_KEYS if isinstance(obj.get(k), int) and not isinstance(obj[k], bool)}
    return Legacy(clean_names(sd), optim, position)


def is_optimizer_state(sd: Any) -> bool:
    """Does ``sd`` look like torch's ``Optimizer.state_dict()`` (groups listing params)?"""
    groups = sd.get("param_groups") if isinstance(sd, dict) else None
    return (isinstance(groups, list) and bool(groups) and isinstance(sd.get("state"), dict)
            and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups))


# Hyperparameters that tell optimizers apart (AdamW's betas, SGD's momentum, ...).
_KIND_KEYS = {"betas", "momentum", "dampening", "nesterov", "amsgrad", "lr_decay", "rho", "alpha", "lambd"}


def map_optimizer_state(sd: dict, groups: list[list[torch.Tensor]], names: dict[int, str],
                        template: dict) -> dict:
    """torch's optimizer state dict ``sd`` (per-parameter state keyed by index, in the order
    the optimizer that saved it held its parameters) mapped onto an optimizer whose groups
    hold ``groups`` (the model's parameters, in order) and whose own ``state_dict()`` is
    ``template``: the same group sizes and each state tensor the shape of its parameter,
    else a ``CheckpointError`` naming the first mismatch. Returns what ``load_state_dict``
    of that optimizer takes, with the job's settings (``template``'s lr, betas, ...).
    ``names``: id(param) -> its name, for messages."""
    theirs = [len(g["params"]) for g in sd["param_groups"]]
    ours = [len(g) for g in groups]
    if theirs != ours:
        raise CheckpointError(f"the file's optimizer holds parameter groups of sizes {theirs}, the job's "
                              f"optimizer {ours}", "build the job's optimizer with the same parameter groups, "
                              "or import the weights only (drop 'optimizer' from the file)")
    differ = {k for g in sd["param_groups"] for k in g} ^ {k for g in template["param_groups"] for k in g}
    if differ & _KIND_KEYS:
        raise CheckpointError(f"the file's optimizer is another kind than the job's (settings "
                              f"{sorted(differ & _KIND_KEYS)} are in one only)",
                              "set the job's optimizer (optimizer.name) to the one that saved the file")
    state, new_groups, index = {}, [], 0
    # Per-parameter state from the file; the settings (lr, betas, ...) stay the job's.
    for group, params, settings in zip(sd["param_groups"], groups, template["param_groups"], strict=True):
        mine = []
        for old, param in zip(group["params"], params, strict=True):
            entry = sd["state"].get(old, sd["state"].get(str(old)))
            for key, value in (entry or {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                    raise CheckpointError(
                        f"the file's optimizer state for parameter {old} ({key}, shape {tuple(value.shape)}) "
                        f"does not fit the model's parameter {index} '{names.get(id(param), '?')}' "
                        f"(shape {tuple(param.shape)})",
                        "save the optimizer built over model.parameters() in the model's order, "
                        "or import the weights only")
            if entry:
                state[index] = entry
            mine.append(index)
            index += 1
        new_groups.append({**settings, "params": mine})
    return {"state": state, "param_groups": new_groups}


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
