"""``train.epochs``: how many optimizer steps N full passes over the data take.

The data is one continuous stream (``data.sampler`` for map-style data, ``data.order`` for
shards): pass ``e + 1`` starts right after the last sample of pass ``e``, a step may
straddle the boundary, and the global batch ``G`` never shrinks. ``N`` epochs of ``S``
samples are ``N * S`` stream positions, and the run takes

    steps = ceil(N * S / G)

so every sample of the ``N`` passes is used exactly once. When ``G`` does not divide
``N * S``, the last step is completed with the next ``steps * G - N * S`` (< G) positions of
the stream, from pass ``N + 1`` on (in its own shuffled order; more than one pass only when
``G > S``); no step is dropped or shortened.

The size must be known before any worker starts (the host resolves ``train.epochs`` into
``train.steps`` once, ``commands.run.preflight``): ``len()`` of a map-style dataset, or the
sum of a stream's ``lengths`` (``Stream(lengths=...)``). A stream without them, or one that
packs documents into sequences (its size is known only after reading every shard), is
refused with the fix. Pure: no torch, no I/O.
"""

from __future__ import annotations

from typing import Any

from elastic_harness.data.stream import Stream
from elastic_harness.errors import UsageError


def steps_for_epochs(epochs: int, samples_per_epoch: int, global_batch: int) -> int:
    """Optimizer steps that cover ``epochs`` full passes (rounded up: see the module doc)."""
    assert epochs > 0 and samples_per_epoch > 0 and global_batch > 0
    return -(-epochs * samples_per_epoch // global_batch)


def samples_per_epoch(source: Any) -> int:
    """Samples in one pass over ``source`` (map-style data or a ``Stream``), known without
    reading it; ``UsageError`` naming the fix when it is not."""
    if not isinstance(source, Stream):
        return len(source)
    if source.pack is not None:
        raise UsageError("train.epochs cannot size a stream that packs documents into sequences: "
                         "its sequence count is known only after reading every shard",
                         "set train.steps instead")
    known = source.known_units()
    if known is None:
        raise UsageError(f"train.epochs needs the stream's size, and {source!r} does not give its "
                         "shards' sample counts", "give Stream(lengths=[samples per shard, ...]), or "
                         "set train.steps instead")
    return sum(known)


def unresolved_epochs(epochs: int, size: int, global_batch: int) -> UsageError:
    """A worker given ``train.epochs`` that no host resolved (a plain ``eh.init(spec)``, a
    script job): the exact ``train.steps`` to set instead."""
    steps = steps_for_epochs(epochs, size, global_batch)
    return UsageError(f"train.epochs {epochs} was not resolved into train.steps before the workers "
                      "started (only `run`/`submit` of a task job do that)",
                      f"set train.steps={steps} instead (ceil({epochs} x {size} samples / {global_batch}))")


def describe(epochs: int, size: int, global_batch: int) -> str:
    """The resolution in words, for the host's output and ``spec``."""
    steps = steps_for_epochs(epochs, size, global_batch)
    return (f"train.epochs {epochs} = {steps} steps (ceil({epochs} x {size} samples / global batch "
            f"{global_batch}))")
