"""Where checkpoints live: a small interface, a local implementation, an fsspec one.

Call order, per save (see ``manager``):

1. rank 0: ``listing()`` to find stale or existing step directories; ``remove(name)`` of a
   stale *incomplete* directory with the same name (never a complete one).
2. every rank: ``writer(name)`` -> a DCP ``StorageWriter``; DCP writes each rank's shards,
   then rank 0 writes ``.metadata``.
3. rank 0: ``files(name)``, ``open_read`` to checksum them, ``write_atomic(name, manifest)``.
4. rank 0: ``remove(name)`` for each checkpoint the retention policy purges.

Per load: rank 0 ``listing()`` and ``read_bytes`` of manifests; every rank ``reader(name)``.
Object stores have no atomic rename; the commit marker is a single small object written
last, which is atomic there (``remote.FsspecStorage``).

A checkpoint directory is trusted input: DCP unpickles ``.metadata`` (see
``docs/checkpoints.md``). Only point the harness at storage that you and your jobs write.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import IO, Protocol


class Storage(Protocol):
    root: str

    def uri(self, name: str) -> str: ...

    def ensure(self) -> None: ...

    def listing(self) -> dict[str, list[str]]: ...

    def files(self, name: str) -> dict[str, int]: ...

    def open_read(self, name: str, filename: str) -> IO[bytes]: ...

    def read_bytes(self, name: str, filename: str) -> bytes: ...

    def write_atomic(self, name: str, filename: str, data: bytes) -> None: ...

    def remove(self, name: str) -> None: ...

    def rename(self, name: str, new_name: str) -> None: ...

    def writer(self, name: str):
        """A fresh DCP ``StorageWriter`` for step directory ``name`` (never overwrites)."""

    def reader(self, name: str):
        """A DCP ``StorageReader`` for step directory ``name``."""


class LocalStorage:
    """A local or shared (NFS, Lustre, RWX volume) directory."""

    def __init__(self, root: str | Path) -> None:
        self.root = str(root)
        self._root = Path(root)

    def uri(self, name: str) -> str:
        return str(self._root / name)

    def ensure(self) -> None:
        self._root.mkdir(parents=True, exist_ok=True)

    def listing(self) -> dict[str, list[str]]:
        if not self._root.is_dir():
            return {}
        out = {}
        for entry in os.scandir(self._root):
            if entry.is_dir():
                out[entry.name] = [f.name for f in os.scandir(entry.path)]
        return out

    def files(self, name: str) -> dict[str, int]:
        d = self._root / name
        return {f.name: f.stat().st_size for f in os.scandir(d) if f.is_file()}

    def open_read(self, name: str, filename: str) -> IO[bytes]:
        return open(self._root / name / filename, "rb")

    def read_bytes(self, name: str, filename: str) -> bytes:
        return (self._root / name / filename).read_bytes()

    def write_atomic(self, name: str, filename: str, data: bytes) -> None:
        final = self._root / name / filename
        tmp = final.with_name(f".{filename}.tmp-{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        _fsync_dir(final.parent)

    def remove(self, name: str) -> None:
        shutil.rmtree(self._root / name, ignore_errors=True)

    def rename(self, name: str, new_name: str) -> None:
        os.replace(self._root / name, self._root / new_name)

    def writer(self, name: str):
        from torch.distributed.checkpoint import FileSystemWriter

        from elastic_harness.checkpoint.integrity import hashing

        # overwrite=False: a save never lands on top of an existing checkpoint (a crash
        # part-way through an in-place overwrite leaves a mix that loads without error).
        return hashing(FileSystemWriter(self.uri(name), sync_files=True, overwrite=False))

    def reader(self, name: str):
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(self.uri(name))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_storage(root: str) -> Storage:
    """``s3://...`` (or any fsspec URL) -> FsspecStorage; a path -> LocalStorage."""
    if "://" in root and not root.startswith("file://"):
        from elastic_harness.checkpoint.remote import FsspecStorage

        return FsspecStorage(root)
    return LocalStorage(root.removeprefix("file://"))
