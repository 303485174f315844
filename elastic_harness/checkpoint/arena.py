"""Staging memory that the checkpoint writer process can read: memfd segments, bump-allocated.

Async saves copy the state into host buffers (``staging``); when those buffers live here,
the writer process (``writer_child``) maps the same pages and writes them out, so the
staging copy stays the only copy. Each segment is an anonymous ``memfd`` (nothing in
``/dev/shm`` or ``/tmp``; freed when the last process holding it closes it or exits).

Placement: the writer process writes a buffer's bytes with ``O_DIRECT`` straight from these
pages when the buffer's address and its bytes' offset in the file agree modulo ``ALIGN``;
otherwise it copies them into an aligned buffer first, which costs training several points
of step time (side by side on the checkpoint bench's model: bounce copy + write +4-7 %,
write from shared memory +0-3 %). Where a tensor lands in its file is known only once it
was serialised, so the recorder reports each misplaced range (``misplaced``) and, at the
next save, the stager asks ``relocate`` for a buffer at the right phase (the old pages are
returned to the kernel).

Call order: ``alloc`` for each staging buffer (a tensor whose own storage is exactly its
bytes, as DCP's writer requires to write it without a clone); ``unsent()`` to learn which
segments a writer process has not mapped yet; ``locate(address, length)`` to turn a byte
range back into ``(segment, offset)``; ``misplaced``/``relocate`` between saves;
``release`` for a buffer no longer staged into; ``close()`` once.

Limits: space is never reused (the stager keeps its buffers for the next save; a state
whose shapes change leaves its old buffers' address space unused until ``close``, though
``release`` returns the memory). Segments grow geometrically, and only written pages take
memory.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

import torch

MIN_SEGMENT = 64 << 20
ALIGN = 4096
PHASE_GRAIN = 64  # torch.save places storage bytes at multiples of 64 in its zip records


@dataclass
class Segment:
    id: int
    fd: int
    size: int
    map: mmap.mmap
    base: int  # address of the mapping in this process
    used: int = 0


def segment_size(need: int, last: int) -> int:
    """Pure: the size of the next segment when ``need`` bytes do not fit in the last one."""
    grow = max(MIN_SEGMENT, 2 * last)
    return max(grow, (need + ALIGN - 1) // ALIGN * ALIGN)


class Arena:
    def __init__(self) -> None:
        self.segments: list[Segment] = []
        self._sent = 0
        self._phases: dict[int, int] = {}  # address of a misplaced buffer: the phase it wants

    def alloc(self, shape: torch.Size | tuple, dtype: torch.dtype, phase: int = 0) -> torch.Tensor:
        """A buffer on pages of its own, starting ``phase`` bytes into its first page."""
        numel = 1
        for n in shape:
            numel *= n
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        seg = self._room(phase + nbytes)
        offset = seg.used + phase
        seg.used = (offset + nbytes + ALIGN - 1) // ALIGN * ALIGN
        return torch.frombuffer(seg.map, dtype=dtype, count=numel, offset=offset).view(shape)

    def misplaced(self, address: int, file_offset: int) -> None:
        """The bytes at ``address`` go to ``file_offset`` in their file (the recorder says)."""
        want = file_offset % ALIGN
        if address % ALIGN != want and want % PHASE_GRAIN == 0:
            self._phases[address] = want

    def relocate(self, buf: torch.Tensor) -> torch.Tensor | None:
        """A buffer like ``buf`` at the phase its last write wanted (``buf``'s pages are
        released: nothing may use it after), or None if ``buf`` is where it should be."""
        phase = self._phases.pop(buf.data_ptr(), None)
        if phase is None:
            return None
        moved = self.alloc(buf.shape, buf.dtype, phase)
        self.release(buf)
        return moved

    def release(self, buf: torch.Tensor) -> None:
        """Give ``buf``'s pages back to the kernel (its space is not reused; reading it gives
        zeros). Nothing may use ``buf`` after."""
        self._phases.pop(buf.data_ptr(), None)
        where = self.locate(buf.data_ptr(), buf.nbytes) if buf.nbytes else None
        if where is not None:
            seg, offset = self.segments[where[0]], where[1]
            start = offset // ALIGN * ALIGN
            seg.map.madvise(mmap.MADV_REMOVE, start, (offset + buf.nbytes + ALIGN - 1) // ALIGN * ALIGN - start)

    def _room(self, nbytes: int) -> Segment:
        last = self.segments[-1] if self.segments else None
        if last is not None and last.size - last.used >= nbytes:
            return last
        size = segment_size(nbytes, last.size if last else 0)
        fd = os.memfd_create(f"eh-ckpt-staging-{len(self.segments)}", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size)
        base = torch.frombuffer(m, dtype=torch.uint8, count=1).data_ptr()
        self.segments.append(Segment(len(self.segments), fd, size, m, base))
        return self.segments[-1]

    def locate(self, address: int, length: int) -> tuple[int, int] | None:
        """``(segment id, offset)`` of ``[address, address + length)``, or None if not here."""
        for seg in self.segments:
            if seg.base <= address and address + length <= seg.base + seg.size:
                return seg.id, address - seg.base
        return None

    def unsent(self) -> list[Segment]:
        """Segments created since the last call (a writer process must map them)."""
        new, self._sent = self.segments[self._sent:], len(self.segments)
        return new

    def resend_all(self) -> None:
        """A new writer process maps nothing yet: the next ``unsent`` returns every segment."""
        self._sent = 0

    def close(self) -> None:
        """Close the fds; a mapping lives on while a staged tensor still views it."""
        for seg in self.segments:
            if seg.fd >= 0:
                os.close(seg.fd)
                seg.fd = -1
        self.segments = []
        self._sent = 0
        self._phases.clear()
