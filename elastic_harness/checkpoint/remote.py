"""Checkpoints in object storage (``s3://bucket/prefix``) or any other fsspec URL.

Same call order as ``storage.LocalStorage`` (see ``storage``); DCP I/O goes through torch's
``FsspecWriter``/``FsspecReader``. Differences that matter:

- Credentials and endpoint come from the environment, read by the client library itself
  (for S3: ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
  ``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION``, or an instance role). They are never part
  of the spec: a URL with ``user:secret@`` is refused, and only the URL is ever logged.
- Object stores have no rename and no directories. The manifest is one small object
  written last with a single PUT, which is atomic there; a "step directory" is a prefix.
- ``sync_files`` is off: an object is durable once its upload completes, and DCP's
  fallback for streams without a file descriptor would ``os.sync()`` the whole host.
- Listings are not cached between calls: another rank or process may have written since.
- ``set_aside`` copies, then deletes the manifest (the commit marker) first, then the rest:
  a crash part-way leaves the old prefix uncommitted, never half a checkpoint that counts.
- ``create_root`` is a check then a write: two writers racing can both believe they created
  the file. The lock (``lock``) reads back what it wrote to narrow that window.
"""

from __future__ import annotations

import contextlib
from typing import IO, TYPE_CHECKING
from urllib.parse import urlsplit

from elastic_harness.checkpoint.layout import MANIFEST
from elastic_harness.checkpoint.streams import watch_writer
from elastic_harness.deps import require_extra
from elastic_harness.errors import CheckpointError

if TYPE_CHECKING:
    from torch.distributed.checkpoint import StorageReader, StorageWriter


def _check_url(url: str) -> None:
    parts = urlsplit(url)
    if "@" in parts.netloc:
        raise CheckpointError(
            f"checkpoint.dir '{parts.scheme}://...@{parts.netloc.rsplit('@', 1)[-1]}' carries "
            "credentials in the URL",
            "remove them; set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or an instance role) in "
            "the environment instead",
        )
    if not parts.netloc:
        raise CheckpointError(f"checkpoint.dir '{url}' names no bucket", "write s3://BUCKET/PREFIX")


class FsspecStorage:
    """A prefix in an fsspec filesystem: ``s3://bucket/prefix``, ``gs://...``, ``memory://...``."""

    def __init__(self, root: str) -> None:
        _check_url(root)
        from fsspec.core import url_to_fs

        self.root = root.rstrip("/")
        if self.root.startswith("s3://"):
            require_extra("s3")
        try:
            self.fs, self._path = url_to_fs(self.root)
        except (ImportError, ValueError) as e:
            raise CheckpointError(
                f"cannot open checkpoint.dir '{self.root}': {e}",
                "install the fsspec backend for this scheme (s3fs for s3://)",
            ) from None
        self._path = self._path.rstrip("/")

    def uri(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _p(self, name: str, filename: str = "") -> str:
        return f"{self._path}/{name}/{filename}" if filename else f"{self._path}/{name}"

    def ensure(self) -> None:
        """Nothing to create on object stores; buckets are made by whoever owns them."""

    def listing(self) -> dict[str, list[str]]:
        self.fs.invalidate_cache()
        try:
            found = self.fs.find(self._path, withdirs=True, detail=True)
        except FileNotFoundError:
            return {}
        out: dict[str, list[str]] = {}
        prefix = self._path + "/"
        for path, info in found.items():
            rel = path[len(prefix):] if path.startswith(prefix) else None
            if not rel:
                continue
            parts = rel.split("/")
            if len(parts) == 1 and info.get("type") == "directory":
                out.setdefault(parts[0], [])
            elif len(parts) == 2 and info.get("type") != "directory":
                out.setdefault(parts[0], []).append(parts[1])
        return out

    def files(self, name: str) -> dict[str, int]:
        self.fs.invalidate_cache()
        found = self.fs.find(self._p(name), detail=True)
        if not found and not self.fs.isdir(self._p(name)):  # on object stores: nothing under it
            raise FileNotFoundError(self.uri(name))
        return {p.rsplit("/", 1)[-1]: int(i["size"]) for p, i in found.items() if i.get("type") != "directory"}

    def open_read(self, name: str, filename: str) -> IO[bytes]:
        return self.fs.open(self._p(name, filename), "rb")

    def read_bytes(self, name: str, filename: str) -> bytes:
        return self.fs.cat_file(self._p(name, filename))

    def write_atomic(self, name: str, filename: str, data: bytes) -> None:
        self.fs.pipe_file(self._p(name, filename), data)

    def make_durable(self, name: str, filenames: list[str]) -> None:
        """Nothing to do: an object is durable once its upload has completed."""

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._p(name), recursive=True)
        self.fs.invalidate_cache()

    def set_aside(self, name: str, new_name: str) -> None:
        self.fs.copy(self._p(name), self._p(new_name), recursive=True)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._p(name, MANIFEST))
        self.remove(name)

    def _root_path(self, filename: str) -> str:
        return f"{self._path}/{filename}"

    def read_root(self, filename: str) -> bytes:
        self.fs.invalidate_cache()
        return self.fs.cat_file(self._root_path(filename))

    def write_root(self, filename: str, data: bytes) -> None:
        self.fs.pipe_file(self._root_path(filename), data)

    def create_root(self, filename: str, data: bytes) -> bool:
        self.fs.invalidate_cache()
        if self.fs.exists(self._root_path(filename)):
            return False
        self.write_root(filename, data)
        return True

    def remove_root(self, filename: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._root_path(filename))
        self.fs.invalidate_cache()

    def free_bytes(self) -> int | None:
        return None  # object stores have no fixed size to report

    def writer(self, name: str) -> StorageWriter:
        from elastic_harness.torchcompat.dcp import fsspec_classes

        writer, _ = fsspec_classes()
        return watch_writer(writer(self.uri(name), sync_files=False, overwrite=False))

    def reader(self, name: str) -> StorageReader:
        from elastic_harness.checkpoint.safe_metadata import fsspec_reader

        return fsspec_reader(self.uri(name))
