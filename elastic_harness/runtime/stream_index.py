"""Bind a stream to a run: size its shards once, fix its order, name it for the checkpoint.

The order (``data.order``) needs each shard's size in units (samples, or tokens when
packing). A stream that does not give ``lengths`` is counted once: every rank counts the
shards ``i % world_size == rank`` (``Stream.units``: file metadata where the adapter can,
else one read), the counts are summed over the checkpoint group (int64 tensors: nothing is
unpickled), and rank 0 writes them to ``RUN_DIR/data/units-<shard list digest>.json`` so a
restart at any world size reads them back instead (rank 0 reads and broadcasts, so every
rank uses the same numbers). Every rank calls ``bind_stream`` at the same point.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elastic_harness.data.order import Layout, StreamOrder, check_sizes
from elastic_harness.data.read import DataError
from elastic_harness.data.stream import Stream
from elastic_harness.errors import HarnessError, UsageError

MAX_LANES_DEFAULT = 64


def digest63(text: str) -> int:
    """A positive int64 digest (DCP saves it as a tensor; 0 means "no stream")."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1 or 1


@dataclass(frozen=True)
class Counting:
    """Who counts a stream's shards: this process (``rank``/``world_size``) among those of
    ``group``, which share the counting; the run's ``cache_dir`` of counts (None: none), and
    ``on_progress``, called after each shard counted (the step watchdog's re-arm)."""

    rank: int
    world_size: int
    group: Any
    cache_dir: Path | None
    on_progress: Callable[[], None] | None = None


def bind_stream(stream: Stream, counting: Counting, *, seed: int, global_batch: int,
                dp_size: int) -> tuple[StreamOrder, tuple[int, int]]:
    """The stream's order and its ``(shard list, order settings)`` digests for ``TrainState``.
    ``dp_size``: the data-parallel degree the lanes are shared over."""
    lanes = stream.lanes or min(global_batch, MAX_LANES_DEFAULT)
    problem = check_sizes(lanes, global_batch, dp_size)
    if problem:
        raise UsageError(problem, "set Stream(lanes=...) between the largest world size and the global "
                         "batch size, on a new run (the lane count fixes the order)")
    units = shard_units(stream, counting)
    unit = stream.pack.seq_len if stream.pack is not None else 1
    layout = Layout(tuple(units), unit, lanes, stream.window, stream.shuffle_shards)
    if layout.samples_per_epoch < global_batch:
        raise UsageError(f"the stream holds {layout.samples_per_epoch} samples per epoch, fewer than "
                         f"the global batch of {global_batch}", "add shards or lower train.global_batch_size")
    settings = json.dumps([*layout.settings(), list(units)])
    return StreamOrder(seed, layout), (digest63(stream.digest()), digest63(settings))


def shard_units(stream: Stream, counting: Counting) -> list[int]:
    c = counting
    rank, world_size, group, cache_dir, on_progress = c.rank, c.world_size, c.group, c.cache_dir, c.on_progress
    known = stream.known_units()
    if known is not None:
        return list(known)
    n = len(stream.shards)
    cache = _cache_path(stream, cache_dir)
    box = torch.zeros(n + 1, dtype=torch.int64)
    if rank == 0 and cache is not None:
        cached = _read_cache(cache, n)
        if cached is not None:
            box[0], box[1:] = 1, torch.tensor(cached, dtype=torch.int64)
    if world_size > 1:
        dist.broadcast(box, group=group, group_src=0)
    if box[0] == 1:
        return box[1:].tolist()
    mine = torch.zeros(n, dtype=torch.int64)
    for i in range(rank, n, world_size):
        mine[i] = count_with_retry(stream, i)
        if on_progress is not None:
            on_progress()
    if world_size > 1:
        dist.all_reduce(mine, group=group)
    units = mine.tolist()
    if rank == 0 and cache is not None:
        _write_cache(cache, units)
    return units


def count_with_retry(stream: Stream, index: int) -> int:
    import time

    for attempt in range(1, stream.retries + 1):
        try:
            return stream.units(index)
        except HarnessError:
            raise
        except Exception as e:  # noqa: BLE001 - user/library I/O: retried, then named
            if attempt == stream.retries:
                raise DataError(f"{stream.name(index)} cannot be read after {attempt} tries "
                                f"(counting its samples): {type(e).__name__}: {str(e)[:200]}",
                                "check that the shard exists and is readable (path, URL, "
                                "credentials); the checkpoints are untouched") from None
            time.sleep(min(0.2 * 2**attempt, 2.0))
    raise AssertionError("not reached")


def _cache_path(stream: Stream, cache_dir: Path | None) -> Path | None:
    if cache_dir is None:
        return None
    kind = f"tokens{stream.pack.seq_len}" if stream.pack is not None else "samples"
    return Path(cache_dir) / f"units-{stream.digest()[:24]}-{kind}.json"


def _read_cache(path: Path, n: int) -> list[int] | None:
    try:
        units = json.loads(path.read_text())["units"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    ok = isinstance(units, list) and len(units) == n and all(isinstance(u, int) and u >= 0 for u in units)
    return units if ok else None


def _write_cache(path: Path, units: list[int]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"units": units}))
        os.replace(tmp, path)
    except OSError:
        pass  # only a cache: the next start counts again
