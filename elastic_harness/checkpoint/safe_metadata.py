"""A checkpoint's ``.metadata``, read without running code.

DCP's readers (``FileSystemReader.read_metadata``; ``FsspecReader`` inherits it) unpickle
``.metadata`` with plain ``pickle.load``, so a planted file runs whatever it names the moment
a resume, ``ckpt export`` or a compatibility check reads it. The manifest's signature says
that this job wrote it, or that someone vouched for it (``ckpt trust``): not what it holds.
Here the file is read with an unpickler that resolves only DCP's metadata types, as
``torch.load(weights_only=True)`` resolves only its allowlist:

- the dataclasses and enums that torch's ``distributed.checkpoint.metadata`` module defines
  (``Metadata``, ``TensorStorageMetadata``, ``ChunkStorageMetadata``, ``TensorProperties``,
  ``MetadataIndex``, ``StorageMeta``...) and those of ``distributed.checkpoint.filesystem``
  (the file readers' storage data, ``_StorageInfo``), found in those modules at import, so
  what a newer torch adds there is admitted without a list to keep up;
- ``torch.Size``, every ``torch`` dtype, the layouts (by the name torch pickles them with,
  resolved here from ``torch``'s own layout objects), file system paths, ``set``,
  ``frozenset``, ``OrderedDict``; and what the user allowed for ``weights_only`` loads with
  ``torch.serialization.add_safe_globals``.

Any other global is refused (``UnsafeMetadata``) before it is looked up: nothing is
imported, nothing called. A value that is not a ``Metadata`` is refused too.

``SafeFileSystemReader`` and ``SafeFsspecReader`` are DCP's readers with ``read_metadata``
replaced (a ``StorageReader`` is DCP's public extension point); ``Storage.reader`` returns
them, so every read of a checkpoint's metadata in the harness (``dcp.load`` on resume,
``compat``, ``offline``) goes through ``load``.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import pathlib
import pickle
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader, filesystem, metadata
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from elastic_harness.checkpoint.layout import METADATA

_FIX = ("it was not written by DCP (planted, or damaged): remove that step directory, or restore it "
        "from a good copy")


class UnsafeMetadata(pickle.UnpicklingError):
    """A ``.metadata`` that names something other than DCP's metadata types."""


def _layout(name: str) -> torch.layout:
    """What torch's layouts unpickle through (``torch.serialization._get_layout``): the
    layout named ``name`` (``"torch.strided"``)."""
    layouts = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
    if name not in layouts:
        raise UnsafeMetadata(f"unknown torch layout {name!r}")
    return layouts[name]


def _types_of(module: Any) -> dict[tuple[str, str], Any]:
    """The dataclasses and enums ``module`` itself defines, by the names pickle uses."""
    return {(module.__name__, name): obj for name, obj in vars(module).items()
            if isinstance(obj, type) and obj.__module__ == module.__name__
            and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))}


def _user_allowed() -> dict[tuple[str, str], Any]:
    """What ``torch.serialization.add_safe_globals`` admitted (an object, or (object, name))."""
    out = {}
    for entry in torch.serialization.get_safe_globals():
        obj, name = entry if isinstance(entry, tuple) else (entry, None)
        if name:
            module, _, attr = name.rpartition(".")
            out[(module, attr)] = obj
        elif hasattr(obj, "__module__") and hasattr(obj, "__qualname__"):
            out[(obj.__module__, obj.__qualname__)] = obj
    return out


def allowed() -> dict[tuple[str, str], Any]:
    """``(module, name) -> object``: the globals a DCP ``.metadata`` may name (module doc),
    less the user's ``add_safe_globals``, which are read at each use (``_user_allowed``)."""
    table = {**_types_of(metadata), **_types_of(filesystem)}
    table.update({("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)})
    table[("torch", "Size")] = torch.Size
    table[("torch.serialization", "_get_layout")] = _layout
    for cls in (pathlib.PurePosixPath, pathlib.PosixPath, pathlib.PureWindowsPath, pathlib.WindowsPath):
        table[("pathlib", cls.__name__)] = table[(cls.__module__, cls.__name__)] = cls
    table.update({("builtins", "set"): set, ("builtins", "frozenset"): frozenset,
                  ("collections", "OrderedDict"): collections.OrderedDict})
    return table


_ALLOWED = allowed()


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: IO[bytes], where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is None:
            found = _user_allowed().get((module, name))
        if found is None:
            raise UnsafeMetadata(f"{self.where} names {module}.{name}, which is not a DCP metadata type: "
                                 f"refused, unread (unpickling it could run code); {_FIX}")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeMetadata(f"{self.where} holds a persistent reference, which DCP metadata never does; {_FIX}")


def load(stream: IO[bytes], where: str = METADATA) -> Metadata:
    """The ``Metadata`` pickled in ``stream``, resolving only DCP's metadata types; raises
    ``UnsafeMetadata`` (an ``UnpicklingError``) naming ``where`` for anything else,
    a damaged pickle included."""
    try:
        value = _Unpickler(stream, where).load()
    except UnsafeMetadata:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            RecursionError) as e:
        raise UnsafeMetadata(f"{where} is not readable DCP metadata ({e!r:.120}); {_FIX}") from None
    if not isinstance(value, Metadata):
        raise UnsafeMetadata(f"{where} holds a {type(value).__name__}, not DCP metadata; {_FIX}")
    return value


def _read_metadata(reader: FileSystemReader, rank: int | None) -> Metadata:
    """What DCP's ``FileSystemReader.read_metadata`` does, through ``load``."""
    path = reader.fs.concat_path(reader.path, METADATA if rank is None else f"__{rank}{METADATA}")
    with reader.fs.create_stream(path, "rb") as stream:
        meta = load(stream, str(path))
    if getattr(meta, "storage_meta", None) is None:
        meta.storage_meta = StorageMeta()
    meta.storage_meta.load_id = reader.load_id
    return meta


class SafeFileSystemReader(FileSystemReader):
    """DCP's file system reader; ``.metadata`` read by ``load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return _read_metadata(self, kwargs.get("rank"))


def fsspec_reader(path: str) -> FileSystemReader:
    """DCP's fsspec reader (``s3://`` and other URLs); ``.metadata`` read by ``load``."""
    from elastic_harness.torchcompat.dcp import fsspec_classes

    _, reader = fsspec_classes()

    class SafeFsspecReader(reader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            return _read_metadata(self, kwargs.get("rank"))

    return SafeFsspecReader(path)
