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

import dataclasses
import hashlib
import json
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from elastic_harness import runfiles


def content_hash(item: Any) -> str:
    """A short digest of a sample's content: whatever a dataset item can hold (module doc of
    ``_feed``). The same content gives the same digest in every process and run (no memory
    addresses, no ``hash()`` salt, no dependence on strides or contiguity); a different
    dtype, shape or container type gives another."""
    h = hashlib.blake2b(digest_size=8)
    _feed(h, item, set())
    return h.hexdigest()


def _put(h: Any, tag: bytes, *parts: bytes) -> None:
    """A tagged, length-prefixed record: no two different sequences of records share bytes."""
    h.update(tag)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)


def _feed(h: Any, x: Any, path: set[int]) -> None:
    """Feed ``x``: None, bool, int, float, complex, str, bytes, tensors of any dtype, layout
    and shape (0-dim, non-contiguous, conjugate or negative views, sparse), numpy arrays and
    scalars, mappings (key order ignored), lists, tuples, namedtuples, sets, dataclasses,
    objects with ``__array__`` (a PIL image), and, for anything else, its type and ``repr``
    (memory addresses masked). ``path``: containers being fed (a cycle is fed as a mark)."""
    if x is None or isinstance(x, (bool, int, float, complex, str, bytes, bytearray, memoryview)):
        _scalar(h, x)
    elif isinstance(x, torch.Tensor):
        _tensor(h, x)
    elif isinstance(x, (np.ndarray, np.generic)):
        _array(h, np.asarray(x))
    elif id(x) in path:
        h.update(b"C")  # a container that holds itself
    else:
        path.add(id(x))
        try:
            _container(h, x, path)
        finally:
            path.discard(id(x))


def _scalar(h: Any, x: Any) -> None:
    if x is None:
        h.update(b"N")
    elif isinstance(x, bool):
        h.update(b"b1" if x else b"b0")
    elif isinstance(x, int):
        _put(h, b"i", str(int(x)).encode())
    elif isinstance(x, float):
        _put(h, b"f", float(x).hex().encode())  # exact: 0.1 and 0.1 + 1e-17 differ
    elif isinstance(x, complex):
        _put(h, b"c", x.real.hex().encode(), x.imag.hex().encode())
    elif isinstance(x, str):
        _put(h, b"s", x.encode("utf-8", "surrogatepass"))
    else:
        _put(h, b"y", bytes(x))


def _tensor(h: Any, t: torch.Tensor) -> None:
    """dtype, shape, then the elements' bytes in logical (row-major) order."""
    t = t.detach()
    header = f"{t.dtype}|{tuple(t.shape)}".encode()
    try:
        if t.layout != torch.strided:
            t = t.to_dense()
        if t.is_quantized:
            t = t.dequantize()
        flat = t.cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)  # 0-dim: one element
        _put(h, b"T", header, flat.view(torch.uint8).numpy().tobytes())
    except (RuntimeError, TypeError, ValueError, NotImplementedError):  # an exotic subclass or layout
        _put(h, b"T?", header, repr(t.tolist()).encode())


def _array(h: Any, a: np.ndarray) -> None:
    dtype = str(a.dtype.descr) if a.dtype.fields else a.dtype.str
    header = f"{dtype}|{a.shape}".encode()
    if a.dtype.hasobject:  # its bytes are pointers: feed the elements
        _put(h, b"O", header)
        for v in a.ravel(order="C"):
            _feed(h, v, set())
        return
    _put(h, b"A", header, a.tobytes(order="C"))


def _container(h: Any, x: Any, path: set[int]) -> None:
    if isinstance(x, Mapping):
        # keys in the order of their own digests: any key types, stable across processes
        pairs = sorted(((content_hash(k), k) for k in x), key=lambda p: p[0])
        _put(h, b"D", str(len(pairs)).encode())
        for _, k in pairs:
            _feed(h, k, path)
            _feed(h, x[k], path)
    elif isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
        _put(h, b"n", type(x).__name__.encode(), ",".join(map(str, x._fields)).encode())
        for v in x:
            _feed(h, v, path)
    elif isinstance(x, (list, tuple)):
        _put(h, b"l" if isinstance(x, list) else b"t", str(len(x)).encode())
        for v in x:
            _feed(h, v, path)
    elif isinstance(x, (set, frozenset)):
        _put(h, b"S", *sorted(content_hash(v).encode() for v in x))
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        _put(h, b"o", _type_name(x).encode())
        _container(h, {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}, path)
    elif hasattr(x, "__array__") or hasattr(x, "__array_interface__"):  # a PIL image, ...
        _put(h, b"o", _type_name(x).encode())
        _array(h, np.asarray(x))
    else:
        _put(h, b"r", _type_name(x).encode(), _ADDRESS.sub(" at 0x?", repr(x)).encode("utf-8", "surrogatepass"))


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _type_name(x: Any) -> str:
    return f"{type(x).__module__}.{type(x).__qualname__}"


@dataclasses.dataclass(frozen=True)
class Writer:
    """Who wrote a sample record: the generation, the rank and its place in the layout
    (``dp_rank``/``dp_size`` default to ``rank`` and ``world_size``: a one-dimensional one)."""

    generation: str
    rank: int
    world_size: int
    dp_rank: int | None = None
    dp_size: int | None = None


def record_samples(path: Path, writer: Writer, step: int, plan: list, meta: list | None) -> None:
    """Append this step's line (``plan``: micro-batches of (position, index); ``meta``: per
    sample (id, hash) in plan order)."""
    pairs = [pair for chunk in plan for pair in chunk]
    w = writer
    line = {"t_ns": time.time_ns(), "generation": w.generation, "step": step, "rank": w.rank,
            "world_size": w.world_size, "dp_rank": w.rank if w.dp_rank is None else w.dp_rank,
            "dp_size": w.world_size if w.dp_size is None else w.dp_size, "positions": [p for p, _ in pairs],
            "indices": [i for _, i in pairs]}
    if meta is not None:
        line["ids"] = [list(i) if isinstance(i, tuple) else i for i, _ in meta]
        line["hashes"] = [h for _, h in meta]
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(line) + "\n").encode())
    finally:
        os.close(fd)


def read_sample_records(run_dir: Path) -> list[dict]:
    """Every rank's records of a run dir, rank file by rank file (a line cut short by a
    killed writer is left out)."""
    out = []
    for path in sorted((run_dir / runfiles.SAMPLES).glob("rank-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out
