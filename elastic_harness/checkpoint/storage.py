"""Where checkpoints live: a small interface, a local implementation, an fsspec one.

Call order, per save (see ``manager``: the saver, and the purger in step 4):

1. rank 0: ``files(name)`` to find an existing step directory of that name; ``remove(name)``
   of a stale *incomplete* one (never a complete one).
2. every rank: ``writer(name)`` -> a DCP ``StorageWriter``; DCP writes each rank's shards,
   then rank 0 writes ``.metadata``.
3. rank 0: ``read_root`` of the generation fence, ``files(name)`` to check every reported
   file is there, ``make_durable(name, [".metadata"])``, then ``write_atomic(name,
   "manifest.json", ...)``: the commit.
4. rank 0: ``listing()``, then ``remove(name)`` for each checkpoint the retention policy
   purges. One listing and one fence read per save.

Per load: rank 0 ``listing()``, ``read_bytes`` of the manifest and ``files(name)``; every
rank ``open_read`` of its share of the files to verify them, then ``reader(name)``. A
checkpoint that fails is moved with ``set_aside(name, new_name)``. Small files at the root
(``read_root``, ``write_root``, ``remove_root``) hold the lock and the generation fence.

Object stores have no atomic rename; the commit marker is a single small object written
last, which is atomic there (``remote.FsspecStorage``).

DCP unpickles ``.metadata``; the readers here read it with an unpickler that admits only
DCP's metadata types (``safe_metadata``), and a checkpoint is read only once its signed
manifest says this job wrote it (``integrity``, ``docs/security.md``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import IO, TYPE_CHECKING, Protocol

from elastic_harness.checkpoint.streams import watch_writer
from elastic_harness.checkpoint.where import is_url, local_path

if TYPE_CHECKING:
    from torch.distributed.checkpoint import StorageReader, StorageWriter


class Storage(Protocol):
    root: str

    def uri(self, name: str) -> str:
        """Where ``name`` (a step directory under the root) lives, for messages and events."""

    def ensure(self) -> None:
        """Create the root if the backend needs it (local directories)."""

    def listing(self) -> dict[str, list[str]]:
        """``{directory name: [file names]}`` one level below the root; files at the root are left out."""

    def files(self, name: str) -> dict[str, int]:
        """``{file name: size}`` in step directory ``name``; ``FileNotFoundError`` if there is
        no such directory (on object stores: no object under it)."""

    def open_read(self, name: str, filename: str) -> IO[bytes]: ...

    def read_bytes(self, name: str, filename: str) -> bytes: ...

    def write_atomic(self, name: str, filename: str, data: bytes) -> None:
        """Write a whole small file: readers see the old state or the new one, never a part."""

    def make_durable(self, name: str, filenames: list[str]) -> None:
        """Flush ``filenames`` in ``name``, ``name`` itself and the root to stable storage."""

    def remove(self, name: str) -> None:
        """Delete step directory ``name`` (missing is fine)."""

    def set_aside(self, name: str, new_name: str) -> None:
        """Move ``name`` to ``new_name`` under the same root; a crash part-way never leaves a
        complete checkpoint under ``name`` that was not there before."""

    def read_root(self, filename: str) -> bytes:
        """A small file at the root; ``FileNotFoundError`` if it does not exist."""

    def write_root(self, filename: str, data: bytes) -> None:
        """Write a small file at the root, whole (last writer wins)."""

    def create_root(self, filename: str, data: bytes) -> bool:
        """Write ``filename`` only if it does not exist; False if it did. Atomic on local
        filesystems; on object stores a check then a write (callers read back)."""

    def remove_root(self, filename: str) -> None: ...

    def free_bytes(self) -> int | None:
        """Bytes a writer may still add under the root where the storage can tell, else None
        (to name a full disk when a writer only reports a short write)."""

    def writer(self, name: str) -> StorageWriter:
        """A fresh DCP ``StorageWriter`` for step directory ``name`` (never overwrites)."""

    def reader(self, name: str) -> StorageReader:
        """A DCP ``StorageReader`` for step directory ``name``, which reads ``.metadata``
        without running code (``safe_metadata``)."""


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
                with contextlib.suppress(FileNotFoundError):  # removed meanwhile
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
        _write_replace(self._root / name / filename, data)

    def make_durable(self, name: str, filenames: list[str]) -> None:
        for filename in filenames:
            _fsync(self._root / name / filename, os.O_RDONLY)
        _fsync(self._root / name, os.O_RDONLY)
        _fsync(self._root, os.O_RDONLY)

    def remove(self, name: str) -> None:
        shutil.rmtree(self._root / name, ignore_errors=True)
        with contextlib.suppress(OSError):
            _fsync(self._root, os.O_RDONLY)

    def set_aside(self, name: str, new_name: str) -> None:
        os.replace(self._root / name, self._root / new_name)
        _fsync(self._root, os.O_RDONLY)

    def read_root(self, filename: str) -> bytes:
        return (self._root / filename).read_bytes()

    def write_root(self, filename: str, data: bytes) -> None:
        _write_replace(self._root / filename, data)

    def create_root(self, filename: str, data: bytes) -> bool:
        """Create ``filename`` with ``data`` only if it does not exist (atomic); False if it did."""
        final = self._root / filename
        tmp = final.with_name(f".{filename}.tmp-{os.getpid()}")
        tmp.write_bytes(data)
        try:
            os.link(tmp, final)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink()

    def remove_root(self, filename: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self._root / filename).unlink()

    def writer(self, name: str) -> StorageWriter:
        from torch.distributed.checkpoint import FileSystemWriter

        # overwrite=False: a save never lands on top of an existing checkpoint (a crash
        # part-way through an in-place overwrite leaves a mix that loads without error).
        return watch_writer(FileSystemWriter(self.uri(name), sync_files=True, overwrite=False))

    def reader(self, name: str) -> StorageReader:
        from elastic_harness.checkpoint.safe_metadata import SafeFileSystemReader

        return SafeFileSystemReader(self.uri(name))

    def free_bytes(self) -> int | None:
        try:
            st = os.statvfs(self.root)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize


def _write_replace(final: Path, data: bytes) -> None:
    """Temp file, fsync, rename over ``final``, fsync the directory."""
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    _fsync(final.parent, os.O_RDONLY)


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_storage(root: str) -> Storage:
    """``s3://...`` (or any fsspec URL) -> FsspecStorage; a path -> LocalStorage."""
    if is_url(root):
        from elastic_harness.checkpoint.remote import FsspecStorage

        return FsspecStorage(root)
    return LocalStorage(local_path(root))
