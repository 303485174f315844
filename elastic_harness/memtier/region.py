"""One memory slot, mapped into a worker: read its header, write a snapshot, publish it.

Write protocol (``begin`` -> copy into ``data()`` -> ``publish``): ``begin`` clears the
published byte before anything else changes, ``publish`` writes the header and sets the
byte last. A process killed anywhere in between leaves the slot unpublished.

The slot grows to what a snapshot needs (``ftruncate``); pages are only allocated when
written, and freed with the memory file (when the agent exits).
"""

from __future__ import annotations

import dataclasses
import mmap
import os

import torch

from elastic_harness.memtier.slots import HEADER_SIZE, PUBLISHED_OFFSET, Header


class Region:
    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR)
        self._size = 0
        self._data: torch.Tensor | None = None  # uint8 view of the whole mapping

    def header(self) -> Header | None:
        return Header.unpack(os.pread(self.fd, HEADER_SIZE, 0))

    def begin(self, size: int) -> torch.Tensor:
        """Unpublish, make room for ``size`` bytes; the slot's bytes (``HEADER_SIZE`` on)."""
        os.pwrite(self.fd, b"\0", PUBLISHED_OFFSET)
        if self._data is not None and self._size >= size:
            return self._data  # only this rank's worker changes the slot's size
        if os.fstat(self.fd).st_size < size:
            os.ftruncate(self.fd, size)
        return self.data()

    def data(self) -> torch.Tensor:
        """The whole slot as a uint8 tensor sharing its memory (remapped if it grew)."""
        size = os.fstat(self.fd).st_size
        if self._data is None or size != self._size:
            # The previous mapping stays alive while a view of it does; then it is unmapped.
            self._data = torch.frombuffer(mmap.mmap(self.fd, size), dtype=torch.uint8)
            self._size = size
        return self._data

    def publish(self, header: Header) -> None:
        """The header with ``published`` cleared, then the published byte: last."""
        unpublished = dataclasses.replace(header, published=False)
        os.pwrite(self.fd, unpublished.pack(), 0)
        os.pwrite(self.fd, b"\1", PUBLISHED_OFFSET)

    def unpublish(self) -> None:
        if os.fstat(self.fd).st_size > PUBLISHED_OFFSET:
            os.pwrite(self.fd, b"\0", PUBLISHED_OFFSET)

    def close(self) -> None:
        self._data = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
