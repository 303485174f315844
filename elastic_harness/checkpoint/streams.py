"""Hooks on DCP's file streams: checksums and byte counts as data goes out or comes in.

``watch_writer`` wraps a DCP ``FileSystemWriter``/``FsspecWriter``'s filesystem so that every
file written gets its size and CRC32 recorded (the manifest uses them without reading the
files back), every byte written is counted (progress), and the write can be *stopped*:
after ``WriteWatch.stop()`` the next write or file creation raises ``WriteStopped``, so
DCP's writer thread ends with an error instead of writing on into a directory someone is
about to remove. ``watch_reader`` counts the bytes a DCP reader reads (progress on load).

Limits: a write already inside the operating system (a hung NFS server) cannot be
interrupted; ``WriteWatch.quiet`` tells the caller when no stream is open any more, which is
the only moment it is safe to touch the directory. This module imports nothing of ours.
"""

from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

CHECKSUM = "crc32"


class Crc32:
    """zlib's CRC32 with hashlib's ``update``/``hexdigest`` shape."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


class WriteStopped(OSError):
    """Raised inside DCP's writer after ``WriteWatch.stop()``: the save was abandoned."""


class Counter:
    """Bytes moved so far, read from other threads; ``on_add(n)`` runs on the moving thread."""

    def __init__(self, on_add: Callable[[int], None] | None = None) -> None:
        self.bytes = 0
        self._on_add = on_add

    def add(self, n: int) -> None:
        self.bytes += n
        if self._on_add is not None:
            self._on_add(n)


class WriteWatch:
    """What one rank's writer did: files with size and checksum, bytes, open streams.

    ``started``/``done`` bracket DCP's ``write_data`` on this rank (the part where bytes
    flow); ``stop()`` makes further writes fail; ``quiet`` is True once stopped with no
    stream open (nothing of this rank can still land in the directory).
    """

    def __init__(self) -> None:
        self.record: dict[str, dict] = {}
        self.counter = Counter()
        self.started = self.done = self.stopped = False
        self._open = 0
        self._lock = threading.Lock()

    def stop(self) -> None:
        self.stopped = True

    @property
    def quiet(self) -> bool:
        with self._lock:
            return self.stopped and self._open == 0

    def _enter(self) -> None:
        with self._lock:
            if self.stopped:
                raise WriteStopped("checkpoint write stopped: the save was abandoned")
            self._open += 1
            self.started = True

    def _leave(self) -> None:
        with self._lock:
            self._open -= 1


class _SummingWriter:
    """A write-only stream that checksums and counts what goes through it (DCP only appends)."""

    def __init__(self, stream: Any, watch: WriteWatch) -> None:
        self._stream, self._watch, self._sum, self.size = stream, watch, Crc32(), 0

    def write(self, data: Any) -> int:
        if self._watch.stopped:
            raise WriteStopped("checkpoint write stopped: the save was abandoned")
        n = self._stream.write(data)
        view = memoryview(data).cast("B")
        n = len(view) if n is None else n
        self._sum.update(view[:n])
        self.size += n
        self._watch.counter.add(n)
        return n

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close, ...
        return getattr(self._stream, name)


class _WatchedFS:
    """Wraps a DCP writer's filesystem: records, counts and can stop what is written."""

    def __init__(self, inner: Any, watch: WriteWatch) -> None:
        self._inner, self.watch = inner, watch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with self._inner.create_stream(path, mode) as stream:
                yield stream
            return
        self.watch._enter()
        try:
            with self._inner.create_stream(path, mode) as stream:
                wrapped = _SummingWriter(stream, self.watch)
                yield wrapped
        finally:
            self.watch._leave()
        filename = os.path.basename(os.fspath(path))
        self.watch.record[filename] = {"size": wrapped.size, CHECKSUM: wrapped._sum.hexdigest()}


def watch_writer(writer: Any) -> Any:
    """Make a DCP ``FileSystemWriter`` (or subclass) record, count and obey ``stop()``."""
    watch = WriteWatch()
    writer.fs = _WatchedFS(writer.fs, watch)
    inner_write_data = writer.write_data

    def write_data(plan: Any, planner: Any) -> Any:
        try:
            return inner_write_data(plan, planner)
        finally:
            watch.done = True

    writer.write_data = write_data
    return writer


def write_watch(writer: Any) -> WriteWatch | None:
    fs = getattr(writer, "fs", None)
    return fs.watch if isinstance(fs, _WatchedFS) else None


def written_files(writer: Any) -> dict[str, dict]:
    """``{filename: {size, crc32}}`` for the files this process wrote through ``writer``.

    DCP writes ``.metadata`` as ``.metadata.tmp`` and renames it: reported as ``.metadata``.
    """
    watch = write_watch(writer)
    record = dict(watch.record) if watch is not None else {}
    if ".metadata.tmp" in record:
        record[".metadata"] = record.pop(".metadata.tmp")
    return record


class _CountingReader:
    def __init__(self, stream: Any, counter: Counter) -> None:
        self._stream, self._counter = stream, counter

    def read(self, size: int = -1) -> bytes:
        data = self._stream.read(size)
        self._counter.add(len(data))
        return data

    def readinto(self, b: Any) -> int:
        n = self._stream.readinto(b)
        self._counter.add(n or 0)
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _CountingFS:
    def __init__(self, inner: Any, counter: Counter) -> None:
        self._inner, self._counter = inner, counter

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        with self._inner.create_stream(path, mode) as stream:
            yield _CountingReader(stream, self._counter) if "r" in mode else stream


def watch_reader(reader: Any, counter: Counter) -> Any:
    """Count the bytes a DCP ``FileSystemReader`` (or subclass) reads into ``counter``."""
    reader.fs = _CountingFS(reader.fs, counter)
    return reader
