"""Adapters at the edge: what ``run.steps(...)`` (or a task's ``dataset()``) may be given.

``source_of(obj)`` sorts it: a map-style dataset (``len`` and ``[i]``) stays as it is; a
``Stream`` is used as is; a Hugging Face ``datasets.IterableDataset`` or a torch
``IterableDataset`` that exposes ``shards`` and ``open_shard(shard)`` becomes a ``Stream``;
anything else (a ``DataLoader``, an iterator, an ``IterableDataset`` without shards, a
map-style dataset without ``len``) is refused with one line naming the fix.

File formats, each a ``Stream`` over paths or URLs (``s3://...`` through fsspec):
``jsonl_stream`` (one JSON document per line), ``tar_stream`` (the webdataset layout: a
sample is the members sharing a key), ``parquet_stream`` (rows through pyarrow, sized from
the file footer and seeked by row group). Libraries are imported only when used.
"""

from __future__ import annotations

import io
import itertools
import json
from collections.abc import Iterator, Sequence
from typing import Any

from elastic_harness.data.stream import Packing, Stream
from elastic_harness.errors import UsageError

_STREAM_FIX = ("give run.steps() the dataset itself: a map-style dataset (len and [i]) or a "
               "stream (elastic_harness.data.Stream(shards, open_shard), a Hugging Face "
               "streaming dataset, or an IterableDataset with shards and open_shard(shard))")


def source_of(obj: Any, **stream_kw: Any) -> Any:
    """``obj`` as map-style data or a ``Stream``; ``UsageError`` for what cannot be resumed."""
    if isinstance(obj, Stream):
        return obj
    kind = type(obj)
    names = {f"{c.__module__}.{c.__qualname__}" for c in kind.__mro__}
    if "torch.utils.data.dataloader.DataLoader" in names:
        raise UsageError(f"run.steps() got a {kind.__name__}, which is a loader, not a dataset: the "
                         "harness batches, shards, prefetches and resumes the data itself",
                         "pass its dataset (loader.dataset); set data.workers/data.prefetch in the job")
    if "datasets.iterable_dataset.IterableDataset" in names:
        return hf_stream(obj, **stream_kw)
    if "torch.utils.data.dataset.IterableDataset" in names:
        shards, opener = getattr(obj, "shards", None), getattr(obj, "open_shard", None)
        if shards is None or not callable(opener):
            raise UsageError(f"{kind.__name__} is an IterableDataset that exposes no shards, so it "
                             "cannot be split over ranks or resumed exactly",
                             "give it a 'shards' list and an 'open_shard(shard)' method that yields "
                             "one shard's samples in order (or build elastic_harness.data.Stream)")
        return Stream(list(shards), opener, skip=getattr(obj, "skip_shard", None),
                      count=getattr(obj, "count_shard", None), **stream_kw)
    if hasattr(obj, "__getitem__"):
        if not callable(getattr(obj, "__len__", None)):
            raise UsageError(f"{kind.__name__} has [i] but no len(): the harness cannot make each "
                             "epoch a permutation of it", "give the dataset a __len__, or make it a stream")
        return obj
    raise UsageError(f"run.steps() got {kind.__name__}, which is neither a dataset nor a stream", _STREAM_FIX)


# ----- Hugging Face datasets ----------------------------------------------------------------
class _HFShard:
    """Opens shard ``i`` of a Hugging Face ``IterableDataset`` (picklable, for loader processes)."""

    def __init__(self, ds: Any) -> None:
        self.ds, self.n = ds, ds.n_shards

    def __call__(self, shard: Any) -> Any:
        return self.ds.shard(num_shards=self.n, index=shard[0], contiguous=True)

    def skip(self, shard: Any, n: int) -> Any:
        return self(shard).skip(n)


def hf_stream(ds: Any, **kw: Any) -> Stream:
    """A ``datasets.IterableDataset``'s own shards (its files, for ``load_dataset(...,
    streaming=True)``), each read with ``ds.shard(n_shards, i)``."""
    n = int(getattr(ds, "n_shards", 0) or 0)
    if n < 1:
        raise UsageError("the Hugging Face IterableDataset has no shards", _STREAM_FIX)
    opener = _HFShard(ds)
    return Stream([(i, *_hf_files(ds, n, i)) for i in range(n)], opener, skip=opener.skip, **kw)


def _hf_files(ds: Any, n: int, i: int) -> tuple[str, ...]:
    """The files behind shard ``i`` (its identity), where the dataset says; else none."""
    try:
        part = ds._ex_iterable.shard_data_sources(num_shards=n, index=i)
        while not hasattr(part, "kwargs") and hasattr(part, "ex_iterable"):  # .map(), .filter()...
            part = part.ex_iterable
        return tuple(str(f) for f in part.kwargs.get("base_files", ()))
    except Exception:  # noqa: BLE001 - a private API: the index alone still names the shard
        return ()


# ----- files (local paths or fsspec URLs) ----------------------------------------------------
def _open_binary(path: str) -> Any:
    import fsspec

    return fsspec.open(str(path), "rb").open()


class _Jsonl:
    def __call__(self, path: str) -> Iterator[Any]:
        with _open_binary(path) as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)


def jsonl_stream(paths: Sequence[str], **kw: Any) -> Stream:
    """One JSON document per line."""
    return Stream([str(p) for p in paths], _Jsonl(), **kw)


def _key(name: str) -> tuple[str, str]:
    """webdataset's grouping: (key, extension) of a member name."""
    folder, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext


class _Unindexable(Exception):
    """A tar that the header walk does not handle (pax/GNU long names, compression)."""


def _members(raw: Any) -> Iterator[tuple[int, str]]:
    """(offset, name) of each regular member of an uncompressed ustar archive, from its
    512-byte headers alone: member data is seeked over, not read."""
    pos = raw.tell()
    while True:
        head = raw.read(512)
        if len(head) < 512 or not head.strip(b"\0"):
            return
        if head[257:262] != b"ustar" or head[124] & 0x80 or head[156:157] in (b"x", b"g", b"L", b"K"):
            raise _Unindexable
        size = int(head[124:136].strip(b"\0 ") or b"0", 8)
        name = head[0:100].split(b"\0", 1)[0]
        prefix = head[345:500].split(b"\0", 1)[0]
        if head[156:157] in (b"0", b"\0", b"7"):
            yield pos, (prefix + b"/" + name if prefix else name).decode()
        pos += 512 + (size + 511) // 512 * 512
        raw.seek(pos)


class _Tar:
    """Samples of a webdataset-layout tar: consecutive members sharing a key (the name up to
    the first dot of its last path part) form ``{"__key__": key, ext: bytes, ...}``.
    ``count`` and ``skip`` walk the headers and seek over member data (plain ustar files,
    as tar and webdataset write them); other archives are read through."""

    def __call__(self, path: str) -> Iterator[dict]:
        return self._samples(path, read=True)

    def count(self, path: str) -> int:
        try:
            with _open_binary(path) as raw:
                keys, last = 0, None
                for _, name in _members(raw):
                    key = _key(name)[0]
                    keys, last = keys + (key != last), key
                return keys
        except _Unindexable:
            return sum(1 for _ in self._samples(path, read=False))

    def skip(self, path: str, n: int) -> Iterator[dict]:
        """Samples from ``n`` on: the headers before it are walked, their data seeked over."""
        try:
            raw = _open_binary(path)
            keys, last = -1, None
            for offset, name in _members(raw):
                key = _key(name)[0]
                keys, last = keys + (key != last), key
                if keys == n:
                    raw.seek(offset)
                    return self._samples(path, read=True, raw=raw)
            raw.close()
            return iter(())
        except _Unindexable:
            raw.close()
            return itertools.islice(self._samples(path, read=True), n, None)

    def _samples(self, path: str, read: bool, raw: Any = None) -> Iterator[dict]:
        import tarfile

        with raw or _open_binary(path) as f, tarfile.open(fileobj=f, mode="r|*") as tar:
            sample: dict[str, Any] = {}
            for member in tar:
                if not member.isfile():
                    continue
                key, ext = _key(member.name)
                if sample and sample["__key__"] != key:
                    yield sample
                    sample = {}
                sample["__key__"] = key
                if read:
                    sample[ext] = tar.extractfile(member).read()
            if sample:
                yield sample


def tar_stream(paths: Sequence[str], **kw: Any) -> Stream:
    """Tar shards in the webdataset layout (``000.cls``, ``000.json``... grouped by key)."""
    reader = _Tar()
    return Stream([str(p) for p in paths], reader, skip=reader.skip, count=reader.count, **kw)


class _Parquet:
    def __init__(self, columns: Sequence[str] | None) -> None:
        self.columns = None if columns is None else list(columns)

    def _file(self, path: str) -> Any:
        import pyarrow.parquet as pq

        return pq.ParquetFile(io.BytesIO(_read_all(path)) if "://" in str(path) else str(path))

    def count(self, path: str) -> int:
        return self._file(path).metadata.num_rows

    def __call__(self, path: str) -> Iterator[dict]:
        return self.skip(path, 0)

    def skip(self, path: str, n: int) -> Iterator[dict]:
        """Rows from ``n`` on: whole row groups before it are not read."""
        f = self._file(path)
        groups, first = [], 0
        for g in range(f.num_row_groups):
            rows = f.metadata.row_group(g).num_rows
            if first + rows > n:
                groups.append(g)
            else:
                first += rows
        for g in groups:
            for row in f.read_row_group(g, columns=self.columns).to_pylist():
                if first >= n:
                    yield row
                first += 1


def _read_all(path: str) -> bytes:
    with _open_binary(path) as f:
        return f.read()


def parquet_stream(paths: Sequence[str], columns: Sequence[str] | None = None, **kw: Any) -> Stream:
    """Parquet files through pyarrow, a row a sample (a dict of the ``columns``)."""
    reader = _Parquet(columns)
    return Stream([str(p) for p in paths], reader, skip=reader.skip, count=reader.count, **kw)


__all__ = ["Packing", "Stream", "hf_stream", "jsonl_stream", "parquet_stream", "source_of", "tar_stream"]
