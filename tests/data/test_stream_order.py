"""The pure order of a sharded stream (``data.order``) and its reading (``data.read``):
world-size-free, exactly once per epoch, resumable from any cursor."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from elastic_harness.data.order import (
    Layout,
    StreamOrder,
    check_sizes,
    reader_of_lane,
    share_sizes,
    step_positions,
    stream_step_plan,
)
from elastic_harness.data.read import DataError, LaneReaders
from elastic_harness.data.stream import Packing, Stream

pytestmark = pytest.mark.timeout(120)

UNITS = (7, 0, 3, 11, 5, 9, 1, 6)  # uneven shards, one empty


def shard_stream(units=UNITS, **kw) -> Stream:
    """Shard i holds samples ``(i, j)``; the test knows every sample's identity."""
    return Stream(list(range(len(units))), lambda i: ((i, j) for j in range(units[i])), lengths=units, **kw)


def positions_by_rank(order, cursor, g, world):
    return [step_positions(order, cursor, g, world, r) for r in range(world)]


@pytest.mark.parametrize("lanes, block, shuffle", [(1, 1, False), (4, 1, True), (5, 3, True), (8, 4, True)])
def test_every_sample_once_per_epoch_and_identity_matches_what_is_read(lanes, block, shuffle):
    layout = Layout(UNITS, 1, lanes, block, shuffle)
    order = StreamOrder(11, layout)
    n = order.n
    assert n == sum(UNITS)
    readers = LaneReaders(shard_stream(), order)
    for epoch in range(3):
        seen = []
        for p in range(epoch * n, (epoch + 1) * n):
            shard, offset, item = readers.read(p)
            assert item == (shard, offset) == order.identity(p)
            seen.append(item)
        assert sorted(seen) == sorted((i, j) for i, u in enumerate(UNITS) for j in range(u))
        canon = [order.canonical(p) for p in range(epoch * n, (epoch + 1) * n)]
        assert sorted(canon) == list(range(n))
    assert readers.opened <= 3 * lanes  # one open per lane per epoch when read in order


def test_order_depends_on_seed_and_epoch_only():
    a, b = StreamOrder(1, Layout(UNITS, 1, 4)), StreamOrder(1, Layout(UNITS, 1, 4))
    n = a.n
    assert [a.identity(p) for p in range(3 * n)] == [b.identity(p) for p in range(3 * n)]
    first, second = [a.identity(p) for p in range(n)], [a.identity(p) for p in range(n, 2 * n)]
    assert first != second  # shards reshuffled per epoch
    c = StreamOrder(2, Layout(UNITS, 1, 4))
    assert first != [c.identity(p) for p in range(n)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("workers", [0, 1, 2, 3])
def test_union_over_ranks_and_loader_processes_is_the_single_rank_step(world, workers):
    g, lanes = 10, 5
    order = StreamOrder(3, Layout(UNITS, 1, lanes, 2))
    single = StreamOrder(3, Layout(UNITS, 1, lanes, 2))
    n = order.n
    # one reader per (rank, loader process): they must never share a lane
    readers = {(r, w): LaneReaders(shard_stream(), order) for r in range(world) for w in range(max(workers, 1))}
    used = []
    for cursor in range(0, 3 * n, g):
        want = [single.identity(p) for p in range(cursor, cursor + g)]
        got = {}
        for r, mine in enumerate(positions_by_rank(order, cursor, g, world)):
            assert mine, "every rank has samples in every step"
            for p in mine:
                w = reader_of_lane(p % lanes, world, max(workers, 1))
                shard, offset, _ = readers[(r, w)].read(p)
                got[p] = (shard, offset)
        assert [got[p] for p in range(cursor, cursor + g)] == want
        used += want
    for e in range(3):
        assert len(set(used[e * n:(e + 1) * n])) == n, "no duplicates within an epoch"
    opened = sum(r.opened for r in readers.values())
    assert opened <= 4 * lanes, "each lane is opened once per epoch (3 and a part) by one process"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_micro_batches_match_across_ranks_and_hold_the_step(world):
    g, lanes = 12, 8
    order = StreamOrder(5, Layout(UNITS, 1, lanes))
    for cursor in range(0, 200, g):
        plans = [stream_step_plan(order, cursor, g, world, r, micro_batch=2) for r in range(world)]
        assert len({len(p) for p in plans}) == 1
        assert all(chunk for p in plans for chunk in p)
        positions = sorted(pos for p in plans for chunk in p for pos, _ in chunk)
        assert positions == list(range(cursor, cursor + g))
        assert sum(share_sizes(lanes, cursor, g, world)) == g


@pytest.mark.parametrize("block", [1, 3])
def test_resume_from_any_cursor_continues_identically(block):
    order = StreamOrder(9, Layout(UNITS, 1, 4, block))
    n = order.n
    ref = LaneReaders(shard_stream(), order)
    full = [ref.read(p)[:2] for p in range(2 * n)]
    rng = random.Random(0)
    for cursor in [0, 1, 5, n - 1, n, n + 3, *rng.sample(range(2 * n), 10)]:
        fresh = LaneReaders(shard_stream(), StreamOrder(9, Layout(UNITS, 1, 4, block)))
        assert [fresh.read(p)[:2] for p in range(cursor, 2 * n)] == full[cursor:]


def test_resume_rereads_at_most_one_shard_part_per_lane():
    calls = []

    def open_shard(i):
        for j in range(UNITS[i]):
            calls.append((i, j))
            yield (i, j)

    stream = Stream(list(range(len(UNITS))), open_shard, lengths=UNITS)
    order = StreamOrder(4, Layout(UNITS, 1, 2))
    readers = LaneReaders(stream, order)
    start = 17
    for p in range(start, start + 6):
        readers.read(p)
    largest = max(UNITS)
    assert len(calls) <= 6 + 2 * largest, "re-read more than one shard's part per lane"


def test_skip_is_used_when_the_source_can_seek():
    opened = []
    stream = Stream(list(range(len(UNITS))), lambda i: opened.append((i, 0)) or iter([(i, j) for j in range(UNITS[i])]),
                    skip=lambda i, n: opened.append((i, n)) or iter([(i, j) for j in range(n, UNITS[i])]),
                    lengths=UNITS)
    order = StreamOrder(0, Layout(UNITS, 1, 1, 1, False))
    assert LaneReaders(stream, order).read(9)[2] == (2, 2)  # shards of 7, 0, 3: sample 9 is (2, 2)
    assert opened == [(2, 2)], "seeked, not opened and read from the start"


def tokens_stream(lengths_per_shard):
    """Documents of given token lengths; token values name (shard, doc, i) uniquely."""
    def open_shard(i):
        for d, length in enumerate(lengths_per_shard[i]):
            yield [i * 1_000_000 + d * 1000 + t for t in range(length)]

    return open_shard


@pytest.mark.parametrize("lanes, block", [(1, 1), (3, 1), (4, 2)])
def test_packing_uses_every_token_once_and_resumes_mid_document(lanes, block):
    rng = np.random.default_rng(0)
    docs = [[int(x) for x in rng.integers(1, 30, size=rng.integers(0, 8))] for _ in range(6)]
    units = tuple(sum(d) for d in docs)
    seq = 16
    stream = Stream(list(range(6)), tokens_stream(docs), pack=Packing(seq))
    assert [stream.units(i) for i in range(6)] == list(units)
    order = StreamOrder(2, Layout(units, seq, lanes, block))
    n = order.n
    assert n == sum(units) // seq
    ref = LaneReaders(stream, order)
    seqs = [ref.read(p) for p in range(2 * n)]
    for e in range(2):
        toks = np.concatenate([s[2] for s in seqs[e * n:(e + 1) * n]])
        assert len(toks) == len(set(toks.tolist())) == n * seq, "each token at most once per epoch"
        for p in range(e * n, (e + 1) * n):
            shard, offset, arr = seqs[p]
            assert (shard, offset) == order.identity(p)
            assert arr.dtype == np.int64 and arr.shape == (seq,)
    for cursor in (1, n // 2, n + 1):
        again = LaneReaders(stream, StreamOrder(2, Layout(units, seq, lanes, block)))
        for p in range(cursor, min(cursor + 5, 2 * n)):
            a = again.read(p)
            assert a[:2] == seqs[p][:2] and np.array_equal(a[2], seqs[p][2])


def test_a_shard_that_cannot_be_read_is_retried_then_named():
    tries = []

    def flaky(i):
        tries.append(i)
        if i == 2 and len([t for t in tries if t == 2]) < 2:
            raise OSError("transient")
        if i == 3:
            raise FileNotFoundError("no such file: s3.jsonl")
        return iter([(i, j) for j in range(UNITS[i])])

    stream = Stream(list(range(len(UNITS))), flaky, lengths=UNITS, retries=3)
    order = StreamOrder(0, Layout(UNITS, 1, 1, 1, False))
    readers = LaneReaders(stream, order)
    for p in range(7 + 3):  # shard 0, then shard 2 after one failure
        readers.read(p)
    with pytest.raises(DataError, match=r"shard 3 \(3\) cannot be read after 3 tries.*no such file"):
        readers.read(10)


def test_a_shard_shorter_than_counted_is_named():
    stream = Stream([0, 1], lambda i: iter(range(3)), lengths=[5, 5])
    readers = LaneReaders(stream, StreamOrder(0, Layout((5, 5), 1, 1, 1, False)))
    with pytest.raises(DataError, match="shard 0 .* ended after 3 samples, but 5 were counted"):
        for p in range(5):
            readers.read(p)


def test_lane_and_world_size_limits_are_explained():
    assert check_sizes(8, 16, 4) is None
    assert "fewer than the 9 ranks" in check_sizes(8, 16, 9)
    assert "global batch is 4" in check_sizes(8, 4, 2)


def test_order_is_fast_enough_for_every_step():
    order = StreamOrder(0, Layout(tuple([1000] * 500), 1, 64, 8))
    for cursor in itertools.islice(range(0, 10**6, 256), 50):
        stream_step_plan(order, cursor, 256, 8, 3, 8)
