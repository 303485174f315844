"""One memory slot, mapped into a worker: read its header, write a snapshot, publish it.

Write protocol (``begin`` -> copy into ``data()`` -> ``publish``): ``begin`` clears the
published byte before anything else changes, ``publish`` writes the header and sets the
byte last. A process killed anywhere in between leaves the slot unpublished.

The slot grows to what a snapshot needs (``ftruncate``); pages are only allocated when
written, and freed with the memory file (when the agent exits).

A snapshot of CUDA tensors copies into a mapping registered with CUDA (``cudaHostRegister``,
page-locked in place): the device-to-host copies then run at pinned-memory speed. Measured on
one H200 (torch 2.11), a 2 GB model + AdamW state: 18 GB/s into the plain mapping, 55 GB/s
registered, the same as a pinned tensor. Registration that fails leaves the slot pageable.
"""

from __future__ import annotations

import contextlib
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
        self._registered = 0  # the mapping's address while registered with CUDA (0: not)

    def header(self) -> Header | None:
        return Header.unpack(os.pread(self.fd, HEADER_SIZE, 0))

    def begin(self, size: int, *, pin: bool = False) -> torch.Tensor:
        """Unpublish, make room for ``size`` bytes; the slot's bytes (``HEADER_SIZE`` on).
        ``pin``: the copies come from a GPU: register the mapping with CUDA (once per mapping)."""
        os.pwrite(self.fd, b"\0", PUBLISHED_OFFSET)
        if self._data is None or self._size < size:  # only this rank's worker changes its size
            if os.fstat(self.fd).st_size < size:
                os.ftruncate(self.fd, size)
            self.data()
        assert self._data is not None
        if pin and not self._registered:
            self._register(self._data)
        return self._data

    def _register(self, data: torch.Tensor) -> None:
        if not torch.cuda.is_available():
            return
        if int(torch.cuda.cudart().cudaHostRegister(data.data_ptr(), data.numel(), 0)) == 0:
            self._registered = data.data_ptr()

    def _unregister(self) -> None:
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self._registered)
            self._registered = 0

    def data(self) -> torch.Tensor:
        """The whole slot as a uint8 tensor sharing its memory (remapped if it grew)."""
        size = os.fstat(self.fd).st_size
        if self._data is None or size != self._size:
            # The previous mapping stays alive while a view of it does; then it is unmapped.
            self._unregister()
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
        self._unregister()
        self._data = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def unpublish(regions: list[Region]) -> None:
    """Unpublish every slot of ``regions`` that can be (a slot that cannot stays as it is)."""
    for region in regions:
        with contextlib.suppress(OSError):
            region.unpublish()
