"""Read a stream's lanes: the I/O half of ``data.order`` (which decides what sits where).

``LaneReaders.read(position)`` returns the sample at a stream position with the identity it
was actually read from: ``(shard list index, unit offset in the shard)``. Each lane keeps one
open, sequential reader; a position that does not continue it (the first read after a
restart, a new epoch) opens the lane's shard at the right offset: ``Stream.skip`` when the
source can seek, else it reads and drops the samples before it, never more than the part of
one shard (plus one shuffle window). Shards that fail to open or read are retried from where
they stopped, then named in a ``DataError``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from elastic_harness.data.order import StreamOrder, Where
from elastic_harness.data.stream import Stream
from elastic_harness.errors import HarnessError

Read = tuple[int, int, Any]  # (shard index, unit offset in the shard, sample)


class DataError(HarnessError):
    """A shard cannot be read, or does not hold what it held when it was counted."""


def _retry_wait(attempt: int) -> float:
    return min(0.2 * 2**attempt, 2.0)


def shard_samples(stream: Stream, index: int, start: int, expected: int | None) -> Iterator[Any]:
    """Shard ``index``'s samples ``start .. expected`` (None: to its end), reopened where it
    stopped on errors."""
    pos, failures = start, 0
    while expected is None or pos < expected:
        try:
            for sample in stream.samples(index, pos):
                yield sample
                pos += 1
                failures = 0
                if pos == expected:
                    return
        except HarnessError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of user/library I/O code is retried
            failures += 1
            if failures >= stream.retries:
                raise DataError(f"{stream.name(index)} cannot be read after {failures} tries "
                                f"(at sample {pos}): {type(e).__name__}: {str(e)[:200]}",
                                "check that the shard exists and is readable (path, URL, "
                                "credentials); the checkpoints are untouched") from None
            time.sleep(_retry_wait(failures))
            continue
        if expected is None:
            return
        raise DataError(f"{stream.name(index)} ended after {pos} samples, but {expected} were "
                        "counted: it changed since it was counted",
                        "shards must not change during a run: restore it, or start a new run")


def epoch_samples(stream: Stream, order: StreamOrder, epoch: int, sample: int) -> Iterator[Read]:
    """Unpacked: the epoch's concatenation from epoch sample ``sample`` on."""
    i, _, offset = order.locate(epoch, sample)
    shards, units = order.shard_order(epoch), order.layout.units
    for at in range(i, len(shards)):
        index = int(shards[at])
        for n, item in enumerate(shard_samples(stream, index, offset, units[index]), offset):
            yield index, n, item
        offset = 0


def epoch_sequences(stream: Stream, order: StreamOrder, epoch: int, sample: int) -> Iterator[Read]:
    """Packed: ``seq_len``-token sequences from epoch sample ``sample`` on. A shard is read from
    its first document to find the token offset (documents have no index)."""
    seq = order.layout.unit
    i, _, token = order.locate(epoch, sample * seq)
    shards, units = order.shard_order(epoch), order.layout.units
    parts: list[np.ndarray] = []
    held, first = 0, None  # tokens held, identity of the first held token
    for at in range(i, len(shards)):
        index, seen = int(shards[at]), 0
        for doc in _docs(stream, index):
            toks = np.asarray(stream.tokens_of(doc), dtype=np.int64)
            lo = max(0, token - seen)
            seen += len(toks)
            if lo >= len(toks):
                continue
            while lo < len(toks):
                take = min(len(toks) - lo, seq - held)
                if first is None:
                    first = (index, seen - len(toks) + lo)
                parts.append(toks[lo : lo + take])
                held, lo = held + take, lo + take
                if held == seq:
                    yield first[0], first[1], np.concatenate(parts)
                    parts, held, first = [], 0, None
        if seen != units[index]:
            raise DataError(f"{stream.name(index)} holds {seen} tokens, but {units[index]} were "
                            "counted: it changed since it was counted",
                            "shards must not change during a run: restore it, or start a new run")
        token = 0


def _docs(stream: Stream, index: int) -> Iterator[Any]:
    """Every document of a shard (its length is only known in tokens)."""
    yield from shard_samples(stream, index, 0, None)


def lane_reader(stream: Stream, order: StreamOrder, w: Where) -> Iterator[Read]:
    """The lane's samples from ``w`` on, in lane order (window-shuffled if configured)."""
    chunk = order.chunk_start(w.epoch, w.lane)
    count = int(order.lane_counts(w.epoch)[w.lane])
    source = epoch_sequences if stream.pack is not None else epoch_samples
    block = order.layout.block
    first = (w.k // block) * block
    it = source(stream, order, w.epoch, chunk + first)
    for start in range(first, count, block):
        size = min(block, count - start)
        window = [next(it) for _ in range(size)]
        for k in range(max(start, w.k), start + size):
            yield window[order.source(Where(w.epoch, w.lane, k)) - start]


class LaneReaders:
    """One process's open lanes. ``read(position)`` in increasing position order per lane."""

    def __init__(self, stream: Stream, order: StreamOrder) -> None:
        self.stream, self.order = stream, order
        self._open: dict[int, tuple[int, int, Iterator[Read]]] = {}  # lane -> (epoch, next k, it)
        self.opened = 0  # lanes (re)opened: a resume opens each of its lanes once

    def read(self, position: int) -> Read:
        w = self.order.where(position)
        got = self._open.get(w.lane)
        if got is None or got[:2] != (w.epoch, w.k):
            got = (w.epoch, w.k, lane_reader(self.stream, self.order, w))
            self.opened += 1
        item = next(got[2])
        self._open[w.lane] = (w.epoch, w.k + 1, got[2])
        return item
