"""A resumable, world-size-free sample stream.

Training reads one endless stream of samples: epoch ``e`` is a permutation of the dataset
seeded by ``(seed, e)``, and the stream is epoch 0, then epoch 1, and so on. Stream position
``p`` is sample ``perm(p // n)[p % n]``. Every optimizer step takes the next
``global_batch_size`` positions, whatever the world size, so a step may straddle an epoch
boundary; nothing is dropped or repeated, so each epoch uses every sample exactly once.

The only state is ``DataState(version, seed, dataset_size, cursor)`` (``epoch`` is derived),
so a run saved at any world size continues at any other. Within a step, data-parallel rank
``r`` of ``D`` takes the contiguous share ``[floor(r*G/D), floor((r+1)*G/D))`` of the step's
positions: shares differ by at most one sample when ``D`` does not divide ``G``.

``D`` is the data-parallel degree (``runtime.topology``: how many different shares a step
reads), not the process count: the ranks of one tensor-parallel group read the same share.
Under ``ddp`` and ``fsdp`` the two are equal.

Pure: numpy only, no torch, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

STATE_VERSION = 1


@dataclass(frozen=True)
class DataState:
    seed: int
    dataset_size: int
    cursor: int = 0  # stream positions consumed so far (all ranks together)
    version: int = STATE_VERSION

    @property
    def epoch(self) -> int:
        return self.cursor // self.dataset_size

    def advance(self, samples: int) -> DataState:
        return DataState(self.seed, self.dataset_size, self.cursor + samples, self.version)


def rank_share(global_batch: int, dp_size: int, dp_rank: int) -> tuple[int, int]:
    """Offsets ``[lo, hi)`` of data-parallel rank ``dp_rank``'s share within one step of
    ``global_batch`` positions."""
    assert 0 <= dp_rank < dp_size <= global_batch
    return (dp_rank * global_batch) // dp_size, ((dp_rank + 1) * global_batch) // dp_size


def micro_batches(global_batch: int, dp_size: int, micro_batch: int) -> int:
    """Micro-batches per rank per step: the same on every rank (collectives must match).

    Enough that the largest share fits ``micro_batch``, but never more than the smallest
    share has samples: every rank then runs every micro-batch on at least one sample (an
    empty micro-batch on one rank would skip a forward its peers' FSDP all-gathers wait on).
    In that corner case (e.g. 3 samples over 2 ranks, micro-batch 1) a micro-batch can hold
    one sample more than ``micro_batch``.
    """
    largest_share = math.ceil(global_batch / dp_size)
    smallest_share = global_batch // dp_size
    return max(1, min(math.ceil(largest_share / micro_batch), smallest_share))


def split(items: list, parts: int) -> list[list]:
    """``items`` in ``parts`` contiguous chunks whose sizes differ by at most one.

    Smaller chunks come first; a chunk is empty only when ``len(items) < parts``.
    """
    n = len(items)
    bounds = [(i * n) // parts for i in range(parts + 1)]
    return [items[bounds[i] : bounds[i + 1]] for i in range(parts)]


class EpochOrder:
    """Per-epoch permutations, cached for the epochs in use."""

    def __init__(self, seed: int, dataset_size: int) -> None:
        if dataset_size <= 0:
            raise ValueError("dataset is empty")
        self.seed = seed
        self.n = dataset_size
        self._cache: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        perm = self._cache.get(epoch)
        if perm is None:
            rng = np.random.default_rng([self.seed, epoch, 0x5EED])
            perm = rng.permutation(self.n)
            self._cache = {epoch: perm, **{e: p for e, p in self._cache.items() if e >= epoch - 1}}
        return perm

    def indices(self, start: int, stop: int) -> list[int]:
        """Dataset indices at stream positions ``[start, stop)``."""
        out: list[int] = []
        pos = start
        while pos < stop:
            epoch, offset = divmod(pos, self.n)
            take = min(stop - pos, self.n - offset)
            out.extend(self.permutation(epoch)[offset : offset + take].tolist())
            pos += take
        return out


def step_plan(
    order: EpochOrder, cursor: int, global_batch: int, dp_size: int, dp_rank: int, micro_batch: int
) -> list[list[tuple[int, int]]]:
    """This rank's micro-batches of the step that starts at ``cursor``.

    Each micro-batch is a list of ``(stream position, dataset index)``; the position names
    the sample's place in the stream, so per-item randomness can be seeded from it and be
    the same whatever the world size or the number of loader processes.
    """
    lo, hi = rank_share(global_batch, dp_size, dp_rank)
    positions = list(range(cursor + lo, cursor + hi))
    pairs = list(zip(positions, order.indices(cursor + lo, cursor + hi), strict=True))
    return split(pairs, micro_batches(global_batch, dp_size, micro_batch))
