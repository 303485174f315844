"""Pure decisions of the in-memory tier: slot headers, which slot to write (which step to
restore is ``choose``'s).

A slot starts with a fixed header; its data follows at ``HEADER_SIZE``. ``published`` is
written last, after everything else, and cleared first when a slot is rewritten, so a
reader never takes a half-written snapshot for a whole one.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

MAGIC = b"EHMEM004"  # 004: the plane and coordinate; 003: the skeleton pickled entry by entry (slots
# live within one job run: no older reader)
HEADER_SIZE = 4096  # data starts page-aligned
SLACK = 4096  # room to spare after a snapshot: its skeleton (plain values, a learning rate) may grow a little
PUBLISHED_OFFSET = len(MAGIC)  # the byte that publishes a slot
# magic, published, replicated, step, world size, rank, data len, skeleton len, digest (the
# replicated byte was padding: a slot written before it existed reads as not replicated), then
# the generation that wrote it (``Header.generation``), the writer's coordinate, then its mesh's
# plane (``MAX_PLANE`` degrees, 0 past the last)
MAX_PLANE = 4  # the dimensions a plane may have: more than the layout has, so a new one fits
_FORMAT = f"<8sBB2xqiiQQ32sqi{MAX_PLANE}i"
_SIZE = struct.calcsize(_FORMAT)


@dataclass(frozen=True)
class Header:
    published: bool
    step: int
    world_size: int
    rank: int
    data_len: int  # tensor bytes, from HEADER_SIZE
    skeleton_len: int  # the pickled skeleton, right after the tensor bytes
    digest: bytes  # of the tensors' layout (``snapshot.Capture.digest``); restores check ``misfit``
    # A full copy of the job's state, the same on every rank (DDP): any rank at any world size
    # may restore from it (``choose``). Never set for sharded state (FSDP, DTensors).
    replicated: bool = False
    # The worker generation that wrote it (its id as an int): a buddy restore takes pieces of
    # one step written by one generation only (``choose``); 0: not known.
    generation: int = 0
    # A mesh layout's snapshot: the degrees of the writer's plane (``Topology.plane``: what
    # stays as replicas come and go; empty: not a mesh's) and its coordinate there. A rank of
    # the same coordinate at another replicate degree may restore from it (``choose``).
    mesh: tuple[int, ...] = ()
    coordinate: int = 0

    def pack(self) -> bytes:
        if len(self.mesh) > MAX_PLANE:
            raise ValueError(f"a plane of {len(self.mesh)} dimensions, at most {MAX_PLANE}")
        return struct.pack(_FORMAT, MAGIC, int(self.published), int(self.replicated), self.step,
                           self.world_size, self.rank, self.data_len, self.skeleton_len, self.digest,
                           self.generation, self.coordinate, *self.mesh, *[0] * (MAX_PLANE - len(self.mesh)))

    @classmethod
    def unpack(cls, raw: bytes) -> Header | None:
        """The header in ``raw``, or None for an empty or foreign slot."""
        if len(raw) < _SIZE:
            return None
        magic, published, replicated, step, world, rank, data_len, skel_len, digest, gen, coordinate, *plane = \
            struct.unpack_from(_FORMAT, raw)
        if magic != MAGIC:
            return None
        return cls(bool(published), step, world, rank, data_len, skel_len, digest, bool(replicated), gen,
                   plane_of(plane), coordinate)


def plane_of(degrees: list[int]) -> tuple[int, ...]:
    """A plane as stored (``MAX_PLANE`` degrees, 0 past the last): its degrees."""
    return tuple(d for d in degrees if d > 0)


def next_slot(last: int | None, slots: int) -> int:
    """The slot to write next: never the one holding the newest snapshot of this rank
    (``last``, the slot last written or restored from), so a rank killed while writing
    still holds its previous snapshot."""
    return 0 if last is None else (last + 1) % slots

