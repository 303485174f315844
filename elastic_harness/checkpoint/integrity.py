"""The commit manifest: what a checkpoint holds, and proof that it is intact.

DCP has no checksums (flipped bytes in a shard load silently). After DCP has written
``.metadata``, rank 0 writes ``manifest.json`` listing every file with its size and
checksum, plus what ``ckpt ls`` shows without reading shards (step, world size). The
manifest is the commit marker: a step directory without it is not a checkpoint.

The checksum is CRC32 (zlib): it catches the accidents this guards against (flipped bits,
truncated or torn files, a shard from another save) and runs 2-3x faster than sha256 here.
It does not resist deliberate tampering, and need not: whoever can write a checkpoint can
already run code through its pickled ``.metadata`` (checkpoints are trusted input).
Manifests that list ``sha256`` (written before) are still verified with sha256.

Cost: each rank checksums its own shards while DCP writes them (``hashing``), in parallel,
so the commit only checksums what it did not see going out (``.metadata``) and nothing
large is read back, which matters for object stores. ``verify`` re-reads on load, several
files at once (zlib and hashlib release the GIL). Modes trade safety for load time:
``full`` re-checksums everything, ``size`` only compares sizes (catches truncation and
missing files, not flipped bytes), ``none`` only requires the manifest to exist.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import os
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from elastic_harness.checkpoint.layout import MANIFEST

if TYPE_CHECKING:
    from elastic_harness.checkpoint.storage import Storage

MANIFEST_VERSION = 1
CHECKSUM = "crc32"
VERIFY_MODES = ("full", "size", "none")
_CHUNK = 8 << 20
_MAX_THREADS = 8


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str = ""


class Crc32:
    """zlib's CRC32 with hashlib's ``update``/``hexdigest`` shape."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def _new(kind: str) -> Any:
    return Crc32() if kind == "crc32" else hashlib.new(kind)


def _covered(filename: str) -> bool:
    """Files the manifest lists: everything but itself and hidden temp files."""
    return filename == ".metadata" or not (filename == MANIFEST or filename.startswith("."))


def checksum_of(storage: Storage, name: str, filename: str, kind: str = CHECKSUM) -> str:
    h = _new(kind)
    with storage.open_read(name, filename) as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def checksum_files(storage: Storage, name: str, todo: dict[str, str]) -> dict[str, str]:
    """``{filename: digest}`` for ``todo`` ``{filename: kind}``, one thread per file (up to 8)."""
    files = sorted(todo)
    threads = max(1, min(_MAX_THREADS, len(files), os.cpu_count() or 1))
    if threads == 1:
        return {f: checksum_of(storage, name, f, todo[f]) for f in files}
    with cf.ThreadPoolExecutor(threads, thread_name_prefix="ckpt-sum") as pool:
        return dict(zip(files, pool.map(lambda f: checksum_of(storage, name, f, todo[f]), files), strict=True))


def build_manifest(storage: Storage, name: str, info: dict, known: dict | None = None) -> dict:
    """List every file of ``name``. ``known`` ``{file: {size, crc32}}`` was checksummed while
    written; it is used where the size on storage agrees, the rest is read and checksummed."""
    known = known or {}
    sizes = {f: s for f, s in sorted(storage.files(name).items()) if _covered(f)}
    todo = {f: CHECKSUM for f in sizes if known.get(f, {}).get("size") != sizes[f] or CHECKSUM not in known[f]}
    digests = {**{f: known[f][CHECKSUM] for f in sizes if f not in todo}, **checksum_files(storage, name, todo)}
    files = {f: {"size": sizes[f], CHECKSUM: digests[f]} for f in sizes}
    return {"version": MANIFEST_VERSION, "created": time.time(), **info, "checksum": CHECKSUM, "files": files}


def write_manifest(storage: Storage, name: str, info: dict, known: dict | None = None) -> dict:
    manifest = build_manifest(storage, name, info, known)
    storage.write_atomic(name, MANIFEST, json.dumps(manifest, indent=1).encode())
    return manifest


def read_manifest(storage: Storage, name: str) -> dict | None:
    try:
        manifest = json.loads(storage.read_bytes(name, MANIFEST))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def verify(storage: Storage, name: str, mode: str = "full") -> Verdict:
    """Check a step directory against its manifest. ``mode``: full, size or none."""
    assert mode in VERIFY_MODES, mode
    manifest = read_manifest(storage, name)
    if manifest is None:
        return Verdict(False, "manifest missing or unreadable")
    if mode == "none":
        return Verdict(True)
    listed = manifest.get("files") or {}
    if ".metadata" not in listed:
        return Verdict(False, "manifest does not list .metadata")
    actual = storage.files(name)
    for filename, want in sorted(listed.items()):
        if filename not in actual:
            return Verdict(False, f"{filename} is missing")
        if actual[filename] != want["size"]:
            return Verdict(False, f"{filename} has {actual[filename]} bytes, expected {want['size']}")
    if mode == "full":
        kinds = {f: ("crc32" if "crc32" in w else "sha256") for f, w in listed.items()}
        digests = checksum_files(storage, name, kinds)
        for filename in sorted(listed):
            if digests[filename] != listed[filename][kinds[filename]]:
                return Verdict(False, f"{filename} checksum mismatch (corrupt)")
    return Verdict(True)


# ----- checksums while writing ------------------------------------------------------------
class _SummingWriter:
    """A write-only stream that checksums what goes through it (DCP only appends)."""

    def __init__(self, stream: Any) -> None:
        self._stream, self._sum, self.size = stream, Crc32(), 0

    def write(self, data: Any) -> int:
        n = self._stream.write(data)
        view = memoryview(data).cast("B")
        n = len(view) if n is None else n
        self._sum.update(view[:n])
        self.size += n
        return n

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close, ...
        return getattr(self._stream, name)


class _SummingFS:
    """Wraps a DCP writer's filesystem: each file written gets its size and checksum recorded."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.record: dict[str, dict] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        with self._inner.create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            wrapped = _SummingWriter(stream)
            yield wrapped
        filename = os.path.basename(os.fspath(path))
        self.record[filename] = {"size": wrapped.size, CHECKSUM: wrapped._sum.hexdigest()}


def hashing(writer: Any) -> Any:
    """Make a DCP ``FileSystemWriter`` (or subclass) checksum files as it writes them."""
    writer.fs = _SummingFS(writer.fs)
    return writer


def written_files(writer: Any) -> dict[str, dict]:
    """``{filename: {size, crc32}}`` for the files this process wrote through ``writer``."""
    return dict(getattr(writer.fs, "record", {}))
