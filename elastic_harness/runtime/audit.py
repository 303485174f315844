"""What ``train.record_samples`` writes: per step and rank, which samples were used and what
they held, so an audit can check exactly-once use *and* that a source returned the data its
position names (``samples/rank-R.jsonl``, one JSON line per step).

Each line: ``step``, ``rank``, ``world_size`` (processes), ``dp_rank`` and ``dp_size`` (the
data-parallel rank and degree, ``runtime.topology``: the share of the step this rank read,
and how many shares there were; the ranks of a tensor-parallel group read the same share;
under ``ddp``/``fsdp`` they equal ``rank`` and ``world_size``), ``generation`` and ``t_ns``
(which attempt ran it), ``positions`` (global stream positions), ``indices`` (the sample's number in its epoch:
a dataset index for map-style data, the first unit's offset in shard-list order for a
stream), ``ids`` (map-style: the index; stream: ``[shard, offset in the shard]``) and
``hashes`` (``content_hash`` of each sample as loaded, before collation).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch


def content_hash(item: Any) -> str:
    """A short digest of a sample's content (tensors, arrays, bytes, str, numbers, nested)."""
    h = hashlib.blake2b(digest_size=8)
    _feed(h, item)
    return h.hexdigest()


def _feed(h: Any, x: Any) -> None:
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(x, np.ndarray):
        a = np.ascontiguousarray(x)
        h.update(f"A{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    elif isinstance(x, (bytes, bytearray, memoryview)):
        h.update(b"B")
        h.update(bytes(x))
    elif isinstance(x, dict):
        h.update(b"D")
        for k in sorted(x, key=str):
            h.update(str(k).encode() + b"=")
            _feed(h, x[k])
    elif isinstance(x, (list, tuple)):
        h.update(b"L")
        for v in x:
            _feed(h, v)
            h.update(b",")
    else:
        h.update(f"{type(x).__name__}:{x!r};".encode())


def record_samples(path: Path, generation: str, step: int, rank: int, world_size: int,
                   plan: list, meta: list | None, *, dp_rank: int | None = None,
                   dp_size: int | None = None) -> None:
    """Append this step's line (``plan``: micro-batches of (position, index); ``meta``: per
    sample (id, hash) in plan order). ``dp_rank``/``dp_size`` default to ``rank`` and
    ``world_size`` (a one-dimensional layout)."""
    pairs = [pair for chunk in plan for pair in chunk]
    line = {"t_ns": time.time_ns(), "generation": generation, "step": step, "rank": rank,
            "world_size": world_size, "dp_rank": rank if dp_rank is None else dp_rank,
            "dp_size": world_size if dp_size is None else dp_size, "positions": [p for p, _ in pairs],
            "indices": [i for _, i in pairs]}
    if meta is not None:
        line["ids"] = [list(i) if isinstance(i, tuple) else i for i, _ in meta]
        line["hashes"] = [h for _, h in meta]
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(line) + "\n").encode())
    finally:
        os.close(fd)
