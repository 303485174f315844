"""A checkpointed state (``runtime.state.build_state``) as tensor bytes plus a skeleton.

``capture(state)`` takes each entry's state dict (``local_state_dict()`` where an entry has
one, see ``runtime.state``; else ``state_dict()``; plain dicts as they are) and splits it
into the tensors (their bytes, at 64-byte aligned offsets; a DTensor contributes its local
shard) and a skeleton: the same nested dicts and lists with each tensor replaced by a
``TensorRef`` and every other value kept. ``layout_digest`` hashes the structure (paths,
tensor dtypes and shapes; not values), so two states with the same digest can be filled
from each other. ``write`` copies the tensors into a slot through typed views of it, which
``Views`` keeps while the layout and the mapping stay the same (a snapshot of a small
model is then a few microseconds of Python per tensor).

``restore_into(state, trees, skeleton, data)`` does what ``dcp.load`` does: ``trees`` are the
current state dicts to restore into (``targets``), the saved bytes are copied into their
tensors in place, the saved plain values put in, and each entry loads the result (plain
dicts are filled in place). Limits: strided tensors only (sparse or nested tensors make
``capture`` raise ``Unsupported``); a GPU tensor is copied through host memory.
"""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

ALIGN = 64
_SCALARS = (int, float, bool, str, type(None))


class Unsupported(TypeError):
    pass


class TensorRef(NamedTuple):  # a tuple: pickled fast, at every snapshot
    offset: int  # from the start of the tensor bytes
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class Capture:
    skeleton: dict[str, Any]
    tensors: list[tuple[TensorRef, torch.Tensor]]
    data_len: int
    digest: bytes

    def pickled(self) -> bytes:
        return pickle.dumps(self.skeleton, protocol=pickle.HIGHEST_PROTOCOL)


def state_dicts(state: dict[str, Any]) -> dict[str, Any]:
    """What a snapshot holds, per entry (see the module docstring)."""
    return {k: _state_dict(v, "local_state_dict") for k, v in state.items()}


def targets(state: dict[str, Any]) -> dict[str, Any]:
    """State dicts to restore into: like ``state_dicts``, with tensors for every state a
    snapshot holds (``local_target``: a fresh optimizer has none yet)."""
    return {k: _state_dict(v, "local_target") for k, v in state.items()}


def _state_dict(entry: Any, local: str) -> Any:
    method = getattr(entry, local, None)
    if callable(method):
        return method()
    return entry.state_dict() if isinstance(entry, Stateful) else entry


def capture(state: dict[str, Any]) -> Capture:
    """The state's tensors (by reference: nothing is copied yet), skeleton and digest."""
    return capture_trees(state_dicts(state))


def layout_digest(trees: dict[str, Any]) -> bytes:
    """The digest ``capture`` gives for these state dicts."""
    return capture_trees(trees).digest


def capture_trees(trees: dict[str, Any]) -> Capture:
    tensors: list[tuple[TensorRef, torch.Tensor]] = []
    layout: list[tuple] = []  # plain tuples: no formatting per snapshot (``_digest``)
    cursor = 0

    def walk(obj: Any, path: tuple) -> Any:
        nonlocal cursor
        if isinstance(obj, torch.Tensor):
            t = _local(obj)
            nbytes = t.numel() * t.element_size()
            ref = TensorRef(cursor, nbytes, t.dtype, tuple(t.shape))
            cursor += -(-nbytes // ALIGN) * ALIGN
            tensors.append((ref, t))
            layout.append((path, _kind(obj), ref.dtype, ref.shape))
            return ref
        if isinstance(obj, dict):
            layout.append((path, "dict", len(obj)))
            return {k: walk(v, (path, k)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            if all(type(v) in _SCALARS for v in obj):  # an optimizer's parameter ids, betas
                layout.append((path, type(obj).__name__, len(obj), "values"))
                return obj
            layout.append((path, type(obj).__name__, len(obj)))
            items = [walk(v, (path, i)) for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else tuple(items)
        layout.append((path, "value"))
        return obj

    skeleton = {k: walk(v, (k,)) for k, v in trees.items()}
    return Capture(skeleton, tensors, cursor, _digest(tuple(layout)))


class Views:
    """Typed views of one slot for one layout, made once and reused while neither changes."""

    def __init__(self) -> None:
        self._key: tuple = ()
        self._views: list[torch.Tensor] = []

    def of(self, cap: Capture, data: torch.Tensor, base: int) -> list[torch.Tensor]:
        key = (cap.digest, id(data), base)
        if key != self._key:
            self._views = [_typed(data, base, ref) for ref, _ in cap.tensors]
            self._key = key
        return self._views


def write(cap: Capture, skeleton: bytes, data: torch.Tensor, base: int, views: Views) -> None:
    """Copy the tensors, then the pickled skeleton, into ``data`` from ``base``."""
    for view, (ref, t) in zip(views.of(cap, data, base), cap.tensors, strict=True):
        if ref.nbytes:
            view.copy_(t.detach())
    start = base + cap.data_len
    data[start:start + len(skeleton)].copy_(torch.frombuffer(bytearray(skeleton), dtype=torch.uint8))


def read_skeleton(data: torch.Tensor, base: int, data_len: int, skeleton_len: int) -> dict[str, Any]:
    start = base + data_len
    return pickle.loads(data[start:start + skeleton_len].numpy().tobytes())


def restore_into(state: dict[str, Any], trees: dict[str, Any], skeleton: dict[str, Any],
                 data: torch.Tensor, base: int) -> None:
    """Fill ``trees`` (``targets(state)``, same layout digest) from the snapshot, then load
    each entry from its filled state dict."""
    with torch.no_grad():
        for key, saved in skeleton.items():
            trees[key] = _fill(trees[key], saved, data, base)
    for key, obj in state.items():
        load = getattr(obj, "load_local_state_dict", None)
        if callable(load):
            load(trees[key])
        elif isinstance(obj, Stateful):
            obj.load_state_dict(trees[key])


def _fill(target: Any, saved: Any, data: torch.Tensor, base: int) -> Any:
    if isinstance(saved, TensorRef):
        if saved.nbytes:
            _local(target).copy_(_typed(data, base, saved))
        return target
    if isinstance(saved, dict):
        for k, v in saved.items():
            target[k] = _fill(target[k], v, data, base)
        return target
    if isinstance(saved, list):
        for i, v in enumerate(saved):
            target[i] = _fill(target[i], v, data, base)
        return target
    if isinstance(saved, tuple):
        return tuple(_fill(t, v, data, base) for t, v in zip(target, saved, strict=True))
    return saved


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose bytes are this rank's: a DTensor's local shard (sharing storage)."""
    local = t.to_local() if isinstance(t, DTensor) else t
    if local.layout != torch.strided or local.is_nested:
        raise Unsupported(f"cannot keep a {local.layout} tensor in memory")
    return local


def _kind(t: torch.Tensor) -> tuple:
    """What besides dtype and local shape must match: a DTensor's global shape and placements."""
    return ("dtensor", tuple(t.shape), tuple(t.placements)) if isinstance(t, DTensor) else ("tensor",)


def _typed(data: torch.Tensor, base: int, ref: TensorRef) -> torch.Tensor:
    """The slot's bytes of ``ref`` seen as its dtype and shape (offsets are aligned)."""
    start = base + ref.offset
    return data[start:start + ref.nbytes].view(ref.dtype).view(ref.shape)


_DIGESTS: dict[tuple, bytes] = {}  # a process sees one or two layouts: hashed once each


def _digest(layout: tuple) -> bytes:
    """sha256 of the layout's text (the same in every process); looking the tuple up costs
    a few microseconds a snapshot, formatting and hashing it a few hundred."""
    digest = _DIGESTS.get(layout)
    if digest is None:
        if len(_DIGESTS) >= 8:
            _DIGESTS.clear()
        digest = _DIGESTS[layout] = hashlib.sha256(repr(layout).encode()).digest()
    return digest
