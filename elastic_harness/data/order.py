"""The global order of a sharded stream: which sample sits at each stream position.

A stream is an ordered list of shards read sequentially. Given how many *units* each shard
holds (samples, or tokens when documents are packed into sequences of ``unit`` tokens),
everything below is a pure function of ``(seed, epoch, shard list)`` and a few fixed
settings, never of the world size or of the number of loader processes:

1. **Epoch concatenation.** Epoch ``e`` reads the shards in an order shuffled from
   ``(seed, e)`` (or list order); concatenated they hold ``U`` units, i.e.
   ``N = U // unit`` samples (epoch sample ``s`` is units ``[s*unit, (s+1)*unit)``; the
   last ``U % unit`` tokens of an epoch are dropped when packing). ``N`` is the same for
   every epoch.
2. **Lanes.** A fixed number ``L`` of lanes (canonical readers, like MosaicML's canonical
   nodes) split each epoch's concatenation into ``L`` contiguous chunks. Stream position
   ``p`` (epoch ``p // N``) belongs to lane ``p % L``; lane ``l`` serves its positions of
   the epoch from its chunk, in order. A lane is read sequentially, so resuming anywhere
   re-reads at most the part of one shard before the position (or seeks there).
3. **Window shuffle (optional).** Within a lane, blocks of ``block`` consecutive samples
   are permuted from ``(seed, epoch, lane, block index)``: a resume re-reads at most one
   block.
4. **Ranks own whole lanes**: lane ``l`` is read by rank ``l % W`` (and, with ``k`` loader
   processes, by process ``(l // W) % k`` of that rank), so each sample is read by one
   process only. A step takes the next ``G`` positions (the global batch); every rank takes
   the positions of its lanes. With ``W <= L <= G`` every rank has samples in every step.

The data state saved in checkpoints is the global cursor (``sampler.DataState``) plus
digests of the shard list and of these settings: nothing per rank.

Pure: numpy only, no torch, no I/O.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import numpy as np

from elastic_harness.data.sampler import split


@dataclass(frozen=True)
class Layout:
    """What fixes the order, besides the seed: validated when built."""

    units: tuple[int, ...]  # units per shard, in shard-list order
    unit: int = 1  # units per sample (1, or the packed sequence length in tokens)
    lanes: int = 1
    block: int = 1  # window-shuffle block (1: lanes read in order)
    shuffle_shards: bool = True

    def __post_init__(self) -> None:
        assert self.unit >= 1 and self.lanes >= 1 and self.block >= 1
        assert all(u >= 0 for u in self.units)

    @property
    def samples_per_epoch(self) -> int:
        return sum(self.units) // self.unit

    def settings(self) -> tuple:
        """What a checkpoint must agree on besides the shard list (``bind_stream`` digests both)."""
        return (self.unit, self.lanes, self.block, self.shuffle_shards)


@dataclass(frozen=True)
class Where:
    """Where a lane's sample comes from: epoch, lane, index within the lane's epoch chunk."""

    epoch: int
    lane: int
    k: int


class StreamOrder:
    """Positions -> (epoch, lane, index in lane) -> (shard, offset in units). Caches per epoch."""

    def __init__(self, seed: int, layout: Layout) -> None:
        self.seed, self.layout = seed, layout
        self.n = layout.samples_per_epoch
        if self.n <= 0:
            raise ValueError("the stream holds no complete sample")
        self._orders: dict[int, tuple[list[int], list[int]]] = {}
        self._counts: dict[int, tuple[list[int], list[int]]] = {}
        self._list_starts = [0, *np.cumsum(layout.units).tolist()]

    # ----- epoch concatenation -----------------------------------------------------------
    def shard_order(self, epoch: int) -> list[int]:
        return self._epoch(epoch)[0]

    def _epoch(self, epoch: int) -> tuple[list[int], list[int]]:
        got = self._orders.get(epoch)
        if got is None:
            s = len(self.layout.units)
            if self.layout.shuffle_shards:
                order = np.random.default_rng([self.seed, epoch, 0x5A4D]).permutation(s)
            else:
                order = np.arange(s)
            units = np.asarray(self.layout.units, dtype=np.int64)[order]
            starts = [0, *np.cumsum(units).tolist()]  # unit offset of each shard in the epoch
            got = (order.tolist(), starts)
            self._orders = {epoch: got, **{e: v for e, v in self._orders.items() if e >= epoch - 1}}
        return got

    def locate(self, epoch: int, unit: int) -> tuple[int, int, int]:
        """Epoch unit offset -> (position in the epoch's shard order, shard list index,
        offset within that shard), skipping empty shards."""
        order, starts = self._epoch(epoch)
        i = bisect.bisect_right(starts, unit) - 1
        return i, order[i], unit - starts[i]

    # ----- lanes ---------------------------------------------------------------------------
    def lane_counts(self, epoch: int) -> list[int]:
        """Samples each lane serves in ``epoch``: positions ``p`` of the epoch with ``p % L == l``."""
        return self._lanes(epoch)[0]

    def _lanes(self, epoch: int) -> tuple[list[int], list[int]]:
        got = self._counts.get(epoch)
        if got is None:
            lanes, n = self.layout.lanes, self.n
            first = epoch * n + (np.arange(lanes) - epoch * n) % lanes
            end = (epoch + 1) * n
            counts = np.where(first < end, (end - 1 - first) // lanes + 1, 0)
            got = (counts.tolist(), [0, *np.cumsum(counts).tolist()])
            self._counts = {epoch: got, **{e: v for e, v in self._counts.items() if e >= epoch - 1}}
        return got

    def chunk_start(self, epoch: int, lane: int) -> int:
        """First epoch sample of the lane's contiguous chunk."""
        return self._lanes(epoch)[1][lane]

    def where(self, position: int) -> Where:
        epoch, lanes = position // self.n, self.layout.lanes
        lane = position % lanes
        first = epoch * self.n + (lane - epoch * self.n) % lanes
        return Where(epoch, lane, (position - first) // lanes)

    def source(self, w: Where) -> int:
        """Index within the lane's chunk that position ``w`` reads (the window shuffle)."""
        b = self.layout.block
        if b == 1:
            return w.k
        count = int(self.lane_counts(w.epoch)[w.lane])
        start = (w.k // b) * b
        size = min(b, count - start)
        perm = np.random.default_rng([self.seed, w.epoch, w.lane, w.k // b, 0xB10C]).permutation(size)
        return start + int(perm[w.k - start])

    def epoch_sample(self, position: int) -> tuple[int, int]:
        """``(epoch, sample index in the epoch's concatenation)`` at ``position``."""
        w = self.where(position)
        return w.epoch, self.chunk_start(w.epoch, w.lane) + self.source(w)

    def identity(self, position: int) -> tuple[int, int]:
        """``(shard list index, unit offset in it)`` of the sample's first unit."""
        epoch, s = self.epoch_sample(position)
        _, shard, offset = self.locate(epoch, s * self.layout.unit)
        return shard, offset

    def canonical(self, position: int) -> int:
        """The sample's first unit as an offset in shard-list order: the same sample has the
        same number in every epoch (unpacked: a dataset index in ``[0, N)``)."""
        shard, offset = self.identity(position)
        return self._list_starts[shard] + offset


# ----- who reads what -----------------------------------------------------------------------
def check_sizes(lanes: int, global_batch: int, dp_size: int) -> str | None:
    """Why this lane count cannot serve this run, or None (a user-facing reason).

    Here and below, ``dp_size``/``dp_rank`` are the data-parallel degree and rank
    (``runtime.topology``): the ranks of one tensor-parallel group read the same lanes."""
    if lanes > global_batch:
        return f"the stream has {lanes} lanes but the global batch is {global_batch}: set lanes <= global batch"
    if dp_size > lanes:
        return (f"the stream has {lanes} lanes, fewer than the {dp_size} ranks (each rank reads "
                f"whole lanes): raise lanes when the stream is first used, or run on <= {lanes} ranks")
    return None


def reader_of_lane(lane: int, dp_size: int, readers: int) -> int:
    """Which of a rank's ``readers`` loader processes reads ``lane``."""
    return (lane // dp_size) % readers


def step_positions(order: StreamOrder, cursor: int, global_batch: int, dp_size: int,
                   dp_rank: int) -> list[int]:
    """This rank's positions in the step that starts at ``cursor``, in order."""
    lanes = order.layout.lanes
    return [p for p in range(cursor, cursor + global_batch) if (p % lanes) % dp_size == dp_rank]


def share_sizes(lanes: int, cursor: int, global_batch: int, dp_size: int) -> list[int]:
    sizes = [0] * dp_size
    for p in range(cursor, cursor + global_batch):
        sizes[(p % lanes) % dp_size] += 1
    return sizes


def stream_step_plan(order: StreamOrder, cursor: int, global_batch: int, dp_size: int,
                     dp_rank: int, micro_batch: int) -> list[list[tuple[int, int]]]:
    """This rank's micro-batches of the step at ``cursor``: lists of (position, canonical
    index). Every rank makes the same number of micro-batches (collectives must match)."""
    sizes = share_sizes(order.layout.lanes, cursor, global_batch, dp_size)
    micro = max(1, min(math.ceil(max(sizes) / micro_batch), min(sizes)))
    pairs = [(p, order.canonical(p)) for p in step_positions(order, cursor, global_batch, dp_size, dp_rank)]
    return split(pairs, micro)
