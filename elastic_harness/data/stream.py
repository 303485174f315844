"""A stream: an ordered list of shards plus a way to read one (the one internal protocol).

Every streaming source the harness takes (``data.adapters``: Hugging Face streaming
datasets, torch ``IterableDataset``s that expose their shards, webdataset-layout tar files,
parquet, jsonl) becomes a ``Stream``. The core (``data.order`` for the order, ``data.read``
for the reading) knows only this class.

Call order, per rank: the harness calls ``count(shard)`` once per shard it must size (split
over the ranks, cached in the run dir) unless ``lengths`` were given; then, in whichever
process reads a lane, ``open(shard)`` (or ``skip(shard, n)`` to start at sample ``n``) and
iterates it until the lane has what it needs. ``open`` must yield the same samples in the same
order every time it is called, in any process: shard contents are the data's identity.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

from elastic_harness.errors import UsageError


@dataclass(frozen=True)
class Packing:
    """Concatenate documents' tokens and cut fixed-length sequences of ``seq_len`` tokens.

    ``tokens(sample)`` gives a document's token ids (any sequence of ints; add an end of
    document id yourself if the model wants one). A packed sample is a numpy int64 array of
    ``seq_len`` tokens; sequences cross document and shard boundaries, and the last
    ``total % seq_len`` tokens of each epoch are not used."""

    seq_len: int
    tokens: Callable[[Any], Sequence[int]] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.seq_len, int) or self.seq_len < 1:
            raise UsageError(f"Packing(seq_len={self.seq_len!r}): must be a positive int",
                             "give the sequence length in tokens")


class Stream:
    """Shards + an opener. See the module docstring for when each callable is called.

    - ``shards``: picklable descriptors (paths, ``s3://`` URLs, tuples...), in a fixed order;
      their ``repr`` is the shard list's identity (a checkpoint refuses another list).
    - ``open(shard)``: an iterable of the shard's samples, in order.
    - ``skip(shard, n)``: optional, the same from sample ``n`` on, faster than reading
      ``n`` samples (a seek); default: open and discard ``n``.
    - ``count(shard)``: optional, how many samples the shard holds (file metadata);
      default: read it once. ``lengths``: the counts, if known.
    - ``pack``: a ``Packing`` to turn documents into fixed-length token sequences.
    - ``lanes``: canonical readers (``data.order``); fixed for the life of a run, bounds
      the world size. Default: ``min(global batch, 64)``.
    - ``window``: shuffle samples within windows of this many per lane (1: in order);
      ``shuffle_shards``: shuffle the shard order per epoch from ``(seed, epoch)``.
    - ``transform(sample)``: per-sample work done in the loader process, with the RNG
      seeded from the sample's stream position (augmentation replays exactly).
    - ``retries``: attempts to open or read a shard before the run stops and names it.
    """

    def __init__(self, shards: Sequence[Any], open: Callable[[Any], Iterable[Any]], *,
                 skip: Callable[[Any, int], Iterable[Any]] | None = None,
                 count: Callable[[Any], int] | None = None, lengths: Sequence[int] | None = None,
                 pack: Packing | None = None, lanes: int | None = None, window: int = 1,
                 shuffle_shards: bool = True, transform: Callable[[Any], Any] | None = None,
                 retries: int = 3) -> None:
        shards = list(shards)
        if not shards:
            raise UsageError("the stream has no shards", "give it at least one shard")
        if not callable(open):
            raise UsageError(f"Stream(open=...) got {type(open).__name__}, not a function",
                             "pass a function that takes a shard and yields its samples")
        if lengths is not None and len(lengths) != len(shards):
            raise UsageError(f"Stream got {len(lengths)} lengths for {len(shards)} shards",
                             "give one length per shard, or none (the harness counts them)")
        if lanes is not None and (not isinstance(lanes, int) or lanes < 1):
            raise UsageError(f"Stream(lanes={lanes!r}): must be a positive int", "e.g. lanes=16")
        if not isinstance(window, int) or window < 1:
            raise UsageError(f"Stream(window={window!r}): must be a positive int", "1 keeps lane order")
        self.shards, self.open, self.skip, self.count = shards, open, skip, count
        self.lengths = None if lengths is None else [int(n) for n in lengths]
        self.pack, self.lanes, self.window, self.shuffle_shards = pack, lanes, window, shuffle_shards
        self.transform, self.retries = transform, max(1, int(retries))

    def __repr__(self) -> str:
        return f"Stream({len(self.shards)} shards, first {self.shards[0]!r})"

    def digest(self) -> str:
        """The shard list's identity (order included)."""
        h = hashlib.sha256()
        for s in self.shards:
            h.update(repr(s).encode())
            h.update(b"\0")
        return h.hexdigest()

    def name(self, index: int) -> str:
        return f"shard {index} ({self.shards[index]!r})"

    # ----- reading one shard (called in whichever process reads a lane) ---------------
    def samples(self, index: int, start: int = 0) -> Iterator[Any]:
        """Shard ``index``'s samples from ``start`` on."""
        shard = self.shards[index]
        if start and self.skip is not None:
            return iter(self.skip(shard, start))
        it = iter(self.open(shard))
        return islice(it, start, None) if start else it

    def units(self, index: int) -> int:
        """Samples in shard ``index`` (tokens when packing): the counting pass."""
        shard = self.shards[index]
        if self.pack is not None:
            return sum(len(self.tokens_of(s)) for s in self.open(shard))
        if self.count is not None:
            return int(self.count(shard))
        if self.lengths is not None:
            return self.lengths[index]
        return sum(1 for _ in self.open(shard))

    def tokens_of(self, sample: Any) -> Sequence[int]:
        fn = self.pack.tokens if self.pack is not None else None
        return fn(sample) if fn is not None else sample

    def known_units(self) -> list[int] | None:
        return self.lengths if self.pack is None else None
