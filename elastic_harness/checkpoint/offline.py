"""Checkpoints seen from one process, without a process group (``ckpt`` commands, tests).

Reading a model: only the ``model.*`` tensors are read; tensors are allocated from
``.metadata`` (global shapes and dtypes) and DCP fills them, resharding from however many
ranks wrote them. Everything lands on CPU, whatever device the saving ranks used.

Finding checkpoints: a user names a run directory, a checkpoint root, one step directory,
or an fsspec URL of either; ``locate`` turns that into a storage and an optional step (a
run directory whose job put its checkpoints elsewhere leads there, see ``where``).
Choosing one: ``newest_usable``, the same ``layout.choose`` a resume uses.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from elastic_harness import runfiles
from elastic_harness.checkpoint import integrity, layout
from elastic_harness.checkpoint.storage import Storage, open_storage
from elastic_harness.checkpoint.where import (
    DEFAULT_SUBDIR,
    checkpoint_root,
    is_url,
    local_path,
)
from elastic_harness.errors import CheckpointError

MODEL_PREFIX = "model."


def load_model_tensors(reader: Any) -> dict[str, torch.Tensor]:
    """``{parameter name: tensor}`` with clean names (no ``model.``/``module.`` prefixes).
    A ``.metadata`` that is not DCP's (``safe_metadata``) is a ``CheckpointError``."""
    import pickle

    try:
        meta = reader.read_metadata().state_dict_metadata
    except pickle.UnpicklingError as e:
        raise CheckpointError(str(e), "nothing was read from it") from None
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
    key_file: Path | None = None  # the run's key (``jobkey``) found beside it, if any


def _key_near(*dirs: Path) -> Path | None:
    """The run dir's key in the first of ``dirs`` that holds one (checkpoints live in the
    run dir by default: the key is then one or two levels up)."""
    from elastic_harness.jobkey import KEY_FILE

    return next((d / KEY_FILE for d in dirs if (d / KEY_FILE).is_file()), None)


def locate(target: str) -> Location:
    """A run dir (its checkpoint root, see ``where``), a checkpoint root, or one step dir; path or URL."""
    if is_url(target):
        head, _, last = target.rstrip("/").rpartition("/")
        if layout.parse_step(last) is not None:
            return Location(open_storage(head), last)
        return Location(open_storage(target))
    path = Path(local_path(target))
    if not path.is_dir():
        raise CheckpointError(f"'{target}' is not a directory", "name a run dir, a checkpoint dir or a step dir")
    path = path.resolve()
    if layout.parse_step(path.name) is not None:
        return Location(open_storage(str(path.parent)), path.name, _key_near(path.parent.parent))
    if (path / runfiles.RESOLVED_SPEC).is_file():
        return Location(open_storage(run_checkpoint_root(path)), None, _key_near(path))
    if (path / DEFAULT_SUBDIR).is_dir():
        return Location(open_storage(str(path / DEFAULT_SUBDIR)), None, _key_near(path))
    return Location(open_storage(str(path)), None, _key_near(path.parent))


def run_checkpoint_root(run_dir: Path) -> str:
    """Where the run in ``run_dir`` keeps its checkpoints, per its resolved spec if it has one."""
    resolved = run_dir / runfiles.RESOLVED_SPEC
    where = ""
    if resolved.is_file():
        from elastic_harness.spec import load_job

        where = load_job(str(resolved)).checkpoint.dir
    return checkpoint_root(where, run_dir)


def describe(storage: Storage, verify_mode: str, key: bytes | None = None) -> list[dict]:
    """One row per step directory, oldest first: step, world size, bytes, status; signatures
    checked with ``key`` (None: not checked).

    Checkpoints set aside after failing are listed too (``quarantined: True``).
    """
    listing = storage.listing()
    rows = []
    for d in layout.scan(listing, require_manifest=True):
        manifest = integrity.read_manifest(storage, d.name) or {}
        row = {
            "step": d.step, "name": d.name, "world_size": manifest.get("world_size"),
            "bytes": sum(storage.files(d.name).values()), "complete": d.complete, "quarantined": False,
        }
        if d.complete:
            verdict = integrity.verify(storage, d.name, verify_mode, key)
            row["verified"] = verdict.ok if verify_mode != "none" or not verdict.ok else None
            row["problem"], row["kind"] = verdict.reason, verdict.kind
        else:
            row["verified"], row["problem"] = False, "incomplete (interrupted save: .metadata or manifest missing)"
        rows.append(row)
    for name in sorted(listing):
        step = layout.parse_quarantined(name)
        if step is not None:
            rows.append({"step": step, "name": name, "world_size": None, "bytes": sum(storage.files(name).values()),
                         "complete": False, "quarantined": True, "verified": False,
                         "problem": "set aside after failing verification or loading"})
    return sorted(rows, key=lambda r: (r["step"], r["quarantined"]))


def newest_usable(storage: Storage, verify_mode: str = "full", step: int | None = None,
                  key: bytes | None = None) -> layout.Choice:
    """The newest complete checkpoint that verifies (of ``step`` only, if given), in this
    process; signed with ``key`` unless it is None (the caller vouches)."""
    listing = storage.listing()
    if step is not None:
        listing = {n: f for n, f in listing.items() if layout.parse_step(n) == step}
    return layout.choose(listing, lambda name: integrity.verify(storage, name, verify_mode, key))


def pick(loc: Location, verify_mode: str = "full", step: int | None = None, key: bytes | None = None) -> str:
    """The step directory to read: the one named, ``step``, or the newest that verifies
    (and is signed with ``key``, unless None)."""
    if loc.step is not None and step is None:
        verdict = integrity.verify(loc.storage, loc.step, verify_mode, key)
        if verdict.ok:
            return loc.step
        reasons = [f"{loc.step}: {verdict.reason}"]
    else:
        choice = newest_usable(loc.storage, verify_mode, step, key)
        if choice.chosen is not None:
            return choice.chosen.name
        reasons = [f"{s.name}: {s.reason}" for s in choice.failed]
    which = f"step {step}" if step is not None else "a complete checkpoint"
    raise CheckpointError(
        f"no usable checkpoint in {loc.storage.root} ({which}); " + ("; ".join(reasons) or "none found"),
        "check the path, or run 'elastic-harness ckpt ls' on it",
    )


@dataclass(frozen=True)
class Review:
    """What ``ckpt trust`` shows before it signs a checkpoint (``review``)."""

    name: str
    manifest: dict  # as read: what is signed if the user agrees
    metadata_sha256: str
    files: list[tuple[str, int, str]]  # (file, size, "crc32 ..." / "sha256 ..."), checked in full
    entries: list[tuple[str, str]]  # (state-dict key, "tensor [shape] dtype" or "pickled value")


def review(storage: Storage, name: str) -> Review:
    """``name`` checked in full against its own manifest, and its state-dict entries as
    ``.metadata`` lists them, read without running code (``safe_metadata``); a
    ``CheckpointError`` saying why it cannot be vouched for otherwise."""
    import hashlib
    import io
    import pickle

    from elastic_harness.checkpoint.safe_metadata import load

    where = storage.uri(name)
    verdict = integrity.verify(storage, name, "full")
    if not verdict.ok:
        raise CheckpointError(f"{where} cannot be vouched for: {verdict.reason}",
                              "only a complete checkpoint that matches its own manifest can be signed")
    manifest = integrity.read_manifest(storage, name) or {}
    data = storage.read_bytes(name, layout.METADATA)
    try:
        meta = load(io.BytesIO(data), f"{where}/{layout.METADATA}")
    except pickle.UnpicklingError as e:  # safe_metadata.UnsafeMetadata: refused or damaged
        raise CheckpointError(f"{where} cannot be vouched for: {e}", "nothing was signed") from None
    sha = hashlib.sha256(data).hexdigest()
    listed = manifest.get("files") or {}
    files = [(f, int(w.get("size", 0)), f"sha256 {sha}" if f == layout.METADATA
              else next((f"{k} {w[k]}" for k in ("crc32", "sha256") if k in w), "-"))
             for f, w in sorted(listed.items())]
    entries = [(k, f"tensor {list(m.size)} {str(m.properties.dtype).removeprefix('torch.')}"
                if isinstance(m, TensorStorageMetadata) else "pickled value (read weights-only)")
               for k, m in sorted(meta.state_dict_metadata.items())]
    return Review(name, manifest, sha, files, entries)
