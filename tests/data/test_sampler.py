"""Sampler math: the stream covers each epoch exactly once, whatever the world sizes."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from elastic_harness.data.sampler import (
    DataState,
    EpochOrder,
    micro_batches,
    rank_share,
    split,
    step_plan,
)


def step_pairs(order, cursor, global_batch, world, rank):
    """(stream position, dataset index) of every sample ``rank`` reads in the step at ``cursor``."""
    return [pair for micro in step_plan(order, cursor, global_batch, world, rank, 2) for pair in micro]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("global_batch", [5, 7, 12, 30])
def test_rank_shares_partition_the_step(world, global_batch):
    if global_batch < world:
        pytest.skip("spec forbids global_batch < world size")
    shares = [rank_share(global_batch, world, r) for r in range(world)]
    assert shares[0][0] == 0 and shares[-1][1] == global_batch
    assert all(a[1] == b[0] for a, b in zip(shares, shares[1:], strict=False))
    sizes = [hi - lo for lo, hi in shares]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_each_epoch_used_exactly_once_at_fixed_world(world):
    n, G = 103, 10  # G does not divide n: steps straddle epoch boundaries
    order = EpochOrder(seed=7, dataset_size=n)
    state = DataState(seed=7, dataset_size=n)
    seen: list[int] = []
    for _ in range(3 * n // G + 1):
        for r in range(world):
            seen += [idx for _, idx in step_pairs(order, state.cursor, G, world, r)]
        state = state.advance(G)
    for epoch in range(3):
        assert sorted(seen[epoch * n:(epoch + 1) * n]) == list(range(n))


@pytest.mark.parametrize("trial", range(20))
def test_random_resize_sequences_cover_each_epoch_once(trial):
    """World size changes between any two steps; an order built fresh after each change
    (a restart) still continues the same stream."""
    rng = random.Random(trial)
    n, G = rng.randint(20, 90), rng.randint(5, 16)
    state = DataState(seed=trial, dataset_size=n)
    per_epoch: dict[int, Counter] = {}
    steps = rng.randint(3, 4) * n // G + 1
    world, order = rng.randint(1, 5), EpochOrder(trial, n)
    for _ in range(steps):
        if rng.random() < 0.3:
            world, order = rng.randint(1, 5), EpochOrder(trial, n)  # a restart at a new size
        for r in range(world):
            for position, idx in step_pairs(order, state.cursor, G, world, r):
                per_epoch.setdefault(position // n, Counter())[idx] += 1
        state = state.advance(G)
    full_epochs = state.cursor // n
    for e in range(full_epochs):
        assert per_epoch[e] == Counter(range(n)), f"epoch {e} not exactly once"


def test_epochs_are_different_permutations_and_seeded():
    a, b = EpochOrder(1, 50), EpochOrder(1, 50)
    assert list(a.permutation(0)) == list(b.permutation(0))
    assert list(a.permutation(0)) != list(a.permutation(1))
    assert list(EpochOrder(2, 50).permutation(0)) != list(a.permutation(0))


def test_split_and_micro_batches():
    assert split(list(range(5)), 3) == [[0], [1, 2], [3, 4]]
    assert split([1, 2], 3) == [[], [1], [2]]
    assert micro_batches(30, 2, 8) == 2  # 15 per rank -> 2 micro-batches
    assert micro_batches(30, 4, 8) == 1  # 8 per rank at most
    # Every rank uses the same count even when shares differ (collectives must match).
    assert micro_batches(7, 3, 2) == 2


def test_state_is_world_size_free():
    fields = set(DataState.__dataclass_fields__)
    assert fields == {"seed", "dataset_size", "cursor", "version"}
    assert DataState(0, 10, 25).epoch == 2
