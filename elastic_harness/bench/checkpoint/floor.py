"""The floor under ``bench checkpoint``'s training overhead: raw durable writes, nothing else.

Every ``every`` steps a background thread in ``SCHED_IDLE`` (as the checkpoint saver's
write thread runs) writes as many bytes as this rank's share of a save, from one
page-aligned buffer, with their CRC32 (what the manifest records), then fsyncs the file and
its directory; the file before last is removed, as retention would. With ``O_DIRECT``
(``direct``: no page-cache copy, no writeback later in a kernel thread) or through the page
cache. No DCP, no staging copy, no commit: what any design that writes those bytes durably
on the same cores pays. (Until 0.3 a separate writer process wrote the floor; those figures
are in docs/benchmarks-history.md.)
"""

from __future__ import annotations

import errno
import mmap
import os
import zlib
from pathlib import Path
from typing import Any

import torch

from elastic_harness.checkpoint.scheduling import BackgroundThreads

ALIGN = 4096  # O_DIRECT: buffer address, length and file offset in whole blocks
CHUNK = 8 << 20


def write_durably(path: Path, data: memoryview, size: int, direct: bool) -> int:
    """Write ``data`` (whole ``ALIGN`` blocks, page-aligned) as a file of ``size`` bytes,
    fsync it and its directory; the CRC32 of those bytes. ``direct`` falls back to the page
    cache where the filesystem has no ``O_DIRECT``."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        fd = os.open(path, flags | (os.O_DIRECT if direct else 0), 0o600)
    except OSError as e:
        if not direct or e.errno != errno.EINVAL:
            raise
        fd = os.open(path, flags, 0o600)
    crc = 0
    try:
        for at in range(0, len(data), CHUNK):
            piece = data[at:at + CHUNK]
            crc = zlib.crc32(piece[:max(0, size - at)], crc)
            done = 0
            while done < len(piece):
                done += os.write(fd, piece[done:])
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return crc


class Floor:
    """One rank's floor: ``saver(direct)`` gives the ``save``/``wait`` pair a window calls."""

    def __init__(self, rank: int, root: Path, tensors: list[torch.Tensor], world: int) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.rank, self.root = rank, root
        flat = torch.cat([t.reshape(-1) for t in tensors])  # weights: 1/3 of the state
        share = torch.cat([flat, flat, flat]).view(torch.uint8)
        share = share[: share.numel() // world]
        self.size = share.numel()
        self.buf = mmap.mmap(-1, -(-self.size // ALIGN) * ALIGN)  # page-aligned
        torch.frombuffer(self.buf, dtype=torch.uint8, count=self.size).copy_(share)
        self.threads = BackgroundThreads(lowered=True)
        self.pending: Any = None
        self.n = 0

    def saver(self, direct: bool) -> Any:
        floor = self

        class Saver:
            def save(self, step: int, state: Any, blocking: bool) -> None:
                floor.save(direct)

            def wait(self) -> None:
                floor.wait()

        return Saver()

    def save(self, direct: bool) -> None:
        self.wait()
        self.n += 1
        self.pending = self.threads.write(self._write, self.n, direct)

    def _write(self, n: int, direct: bool) -> None:
        write_durably(self.root / f"rank{self.rank}-{n}.bin", memoryview(self.buf), self.size, direct)
        (self.root / f"rank{self.rank}-{n - 1}.bin").unlink(missing_ok=True)

    def wait(self) -> None:
        if self.pending is not None:
            with self.threads.foreground():
                self.pending.result()
            self.pending = None

    def close(self) -> None:
        self.wait()
        self.threads.shutdown()
        self.buf.close()
