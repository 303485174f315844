"""The commit manifest: what a checkpoint holds, and proof that it is intact.

DCP has no checksums (flipped bytes in a shard load silently). After DCP has written
``.metadata``, rank 0 writes ``manifest.json`` listing every file with its size and
sha256, plus what ``ckpt ls`` shows without reading shards (step, world size). The manifest
is the commit marker: a step directory without it is not a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass

from elastic_harness.checkpoint.layout import MANIFEST
from elastic_harness.checkpoint.storage import Storage

MANIFEST_VERSION = 1
_CHUNK = 8 << 20


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str = ""


def _covered(filename: str) -> bool:
    """Files the manifest lists: everything but itself and hidden temp files."""
    return filename == ".metadata" or not (filename == MANIFEST or filename.startswith("."))


def sha256_of(storage: Storage, name: str, filename: str) -> str:
    h = hashlib.sha256()
    with storage.open_read(name, filename) as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def build_manifest(storage: Storage, name: str, info: dict) -> dict:
    files = {}
    for filename, size in sorted(storage.files(name).items()):
        if not _covered(filename):
            continue
        files[filename] = {"size": size, "sha256": sha256_of(storage, name, filename)}
    return {"version": MANIFEST_VERSION, "created": time.time(), **info, "files": files}


def write_manifest(storage: Storage, name: str, info: dict) -> dict:
    manifest = build_manifest(storage, name, info)
    storage.write_atomic(name, MANIFEST, json.dumps(manifest, indent=1).encode())
    return manifest


def read_manifest(storage: Storage, name: str) -> dict | None:
    try:
        return json.loads(storage.read_bytes(name, MANIFEST))
    except (OSError, FileNotFoundError, ValueError):
        return None


def verify(storage: Storage, name: str, mode: str = "full") -> Verdict:
    """Check a step directory against its manifest. ``mode``: full, size or none."""
    manifest = read_manifest(storage, name)
    if manifest is None:
        return Verdict(False, "manifest missing or unreadable")
    if mode == "none":
        return Verdict(True)
    actual = storage.files(name)
    for filename, want in manifest.get("files", {}).items():
        if filename not in actual:
            return Verdict(False, f"{filename} is missing")
        if actual[filename] != want["size"]:
            return Verdict(False, f"{filename} has {actual[filename]} bytes, expected {want['size']}")
        if mode == "full" and sha256_of(storage, name, filename) != want["sha256"]:
            return Verdict(False, f"{filename} checksum mismatch (corrupt)")
    return Verdict(True)
