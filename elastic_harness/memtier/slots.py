"""Pure decisions of the in-memory tier: slot headers, which slot to write, which step to use.

A slot starts with a fixed header; its data follows at ``HEADER_SIZE``. ``published`` is
written last, after everything else, and cleared first when a slot is rewritten, so a
reader never takes a half-written snapshot for a whole one.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

MAGIC = b"EHMEM001"
HEADER_SIZE = 4096  # data starts page-aligned
PUBLISHED_OFFSET = len(MAGIC)  # the byte that publishes a slot
_FORMAT = "<8sB3xqiiQQ32s"  # magic, published, step, world size, rank, data len, skeleton len, digest
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

    def pack(self) -> bytes:
        return struct.pack(_FORMAT, MAGIC, int(self.published), self.step, self.world_size, self.rank,
                           self.data_len, self.skeleton_len, self.digest)

    @classmethod
    def unpack(cls, raw: bytes) -> Header | None:
        """The header in ``raw``, or None for an empty or foreign slot."""
        if len(raw) < _SIZE:
            return None
        magic, published, step, world, rank, data_len, skel_len, digest = struct.unpack_from(_FORMAT, raw)
        if magic != MAGIC:
            return None
        return cls(bool(published), step, world, rank, data_len, skel_len, digest)


def usable_steps(headers: Sequence[Header | None], *, world_size: int, rank: int) -> dict[int, int]:
    """``{step: slot}`` of the published snapshots this rank wrote at this world size. (The
    state's layout is checked after the ranks agree on a step, ``snapshot.misfit``: it needs
    the live state's ``state_dict()``, which initialises an empty optimizer's state.)"""
    out = {}
    for slot, h in enumerate(headers):
        if h is not None and h.published and (h.world_size, h.rank) == (world_size, rank):
            out[h.step] = slot
    return out


def newest_common(per_rank: Sequence[Sequence[int]]) -> int | None:
    """The newest step that every rank holds, or None (then all ranks use storage)."""
    if not per_rank:
        return None
    common = set(per_rank[0]).intersection(*per_rank[1:])
    return max(common) if common else None


def next_slot(last: int | None, slots: int) -> int:
    """The slot to write next: never the one holding the newest snapshot of this rank
    (``last``, the slot last written or restored from), so a rank killed while writing
    still holds its previous snapshot."""
    return 0 if last is None else (last + 1) % slots

