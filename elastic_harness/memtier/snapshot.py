"""A checkpointed state (``runtime.state.build_state``) as tensor bytes plus a skeleton.

``capture(state)`` takes each entry's state dict (``local_state_dict()`` where an entry has
one, see ``runtime.state``; else ``state_dict()``; plain dicts as they are) and splits it
into the tensors (their bytes, at 64-byte aligned offsets; a DTensor contributes its local
shard) and a skeleton: the same nested dicts and lists with each tensor replaced by a
``TensorRef`` and every other value kept, pickled entry by entry (``Capture.parts``; a slot
holds them as one pickled dict of those pickles, ``pack``/``unpack``: a buddy copy then
re-encodes as JSON only the entries whose pickle changed, usually the train position). The
capture's digest hashes the tensors' dtypes, shapes and kinds in order (it names the byte
layout; a ``Replicate`` placement aside, ``_split``); ``misfit`` checks a saved
skeleton against the state to restore into, key by key. ``write`` copies the tensors into
a slot through typed views of it, which ``Views`` keeps while the layout and the mapping
stay the same. A snapshot of a small model is then ~0.2 ms of Python in all: the state
dicts torch builds, one C pickler pass, one fused copy.

``restore_into(state, trees, skeleton, data)`` does what ``dcp.load`` does: ``trees`` are the
current state dicts to restore into (``targets``), the saved bytes are copied into their
tensors in place, the saved plain values put in, and each entry loads the result (plain
dicts are filled in place). Limits: strided tensors only (sparse or nested tensors make
``capture`` raise ``Unsupported``); a GPU tensor is copied through host memory.
"""

from __future__ import annotations

import hashlib
import io
import pickle
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor, Replicate

from elastic_harness.torchcompat import nn as compat_nn
from elastic_harness.torchcompat.nn import copy_all

ALIGN = 64


class Unsupported(TypeError):
    pass


class TensorRef(NamedTuple):  # a tuple: pickled fast, at every snapshot
    offset: int  # from the start of the tensor bytes
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]  # local: a DTensor's shard
    kind: tuple  # ``_kind``: a DTensor's global shape and placements


@dataclass
class Capture:
    skeleton: bytes  # ``pack(parts)``: what a slot holds after the tensor bytes
    parts: dict[str, bytes]  # each entry's pickled state dict, a ``TensorRef`` in place of each tensor
    tensors: list[tuple[tuple, torch.Tensor]]  # (``TensorRef`` fields, tensor), as pickled
    data_len: int
    digest: bytes  # of the tensors' dtypes, shapes and kinds, in order
    sources: list[torch.Tensor]  # the tensors with bytes to copy, in order
    cpu: bool  # every one of them is in host memory: one fused copy
    sharded: bool = False  # some tensor is a DTensor (a shard): never a replicated snapshot
    # Each source's version counter when captured (``intact``): autograd bumps it at every
    # in-place change (an optimizer step, a ``copy_``), so bytes written later are still the
    # captured state's while every counter is unchanged.
    versions: tuple[int, ...] = ()


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
    """The state's tensors (by reference: nothing is copied yet), pickled skeleton and digest.

    Under ``no_grad``: a DTensor's ``to_local`` is then its local shard itself, not an
    autograd op (~30 us each under FSDP2, for every parameter and optimizer state, every
    snapshot: most of an FSDP2 snapshot's cost)."""
    with torch.no_grad():
        return capture_trees(state_dicts(state))


def capture_trees(trees: dict[str, Any]) -> Capture:
    """One pass of the C pickler over each entry of ``trees``: each tensor it meets is swapped
    for a ``TensorRef`` (``_Pickler.reducer_override``), so no Python code walks the dicts.

    A Python walk that built paths and a layout per node cost ~150 us for a small model's
    optimizer state, every snapshot; the pickler visits plain values in C and calls back only
    for tensors and other non-builtin objects. A tensor reached twice within an entry (tied
    weights) is one reference (the pickler's memo); one reached from two entries is kept
    twice (each entry's pickle stands alone)."""
    if torch.is_grad_enabled():  # see ``capture``
        with torch.no_grad():
            return capture_trees(trees)
    found = _Found()
    parts = {}
    for key, tree in trees.items():
        buf = io.BytesIO()
        _Pickler(buf, found).dump(tree)
        parts[key] = buf.getvalue()
    return Capture(pack(parts), parts, found.tensors, found.cursor, _digest(tuple(found.layout)),
                   found.sources, found.cpu, found.sharded, compat_nn.versions(found.sources) or ())


def intact(cap: Capture) -> bool:
    """Does every tensor still hold the bytes it held when ``cap`` was taken? (No in-place
    change since, by the version counters autograd keeps. A change made through ``.data``
    bypasses them: a script that does that between steps turns ``memory_on_failure`` off.)"""
    return len(cap.versions) == len(cap.sources) and compat_nn.versions(cap.sources) == cap.versions


def pack(parts: dict[str, bytes]) -> bytes:
    """The skeleton a slot holds: the entries' pickles (``Capture.parts``), as one pickle."""
    return pickle.dumps(parts, protocol=pickle.HIGHEST_PROTOCOL)


def unpack(raw: bytes) -> dict[str, Any]:
    """``pack``'s inverse, each entry unpickled: the skeleton (our own bytes only)."""
    return {k: pickle.loads(v) for k, v in pickle.loads(raw).items()}


def pack_skeleton(skeleton: Any) -> bytes:
    """A skeleton's slot bytes (``pack``), from its entries; ``ValueError`` if it is not a
    dict of entries."""
    if not (isinstance(skeleton, dict) and all(type(k) is str for k in skeleton)):
        raise ValueError("a skeleton is a dict of named entries")
    return pack({k: pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL) for k, v in skeleton.items()})


class _Found:
    """What the entries' picklers found, in order: one byte layout for all entries."""

    def __init__(self) -> None:
        self.tensors: list[tuple[tuple, torch.Tensor]] = []  # (``TensorRef`` fields, tensor)
        self.layout: list[tuple] = []  # what must match for another state to load these bytes
        self.cursor = 0
        self.sources: list[torch.Tensor] = []
        self.cpu = True
        self.sharded = False


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, found: _Found) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.found = found

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) in _PLAIN:  # most tensors: a few microseconds less each than the general path
            t, kind = obj, _PLAIN_KIND
            if t.layout != torch.strided or t.is_nested:
                raise Unsupported(f"cannot keep a {t.layout} tensor in memory")
        elif isinstance(obj, torch.Tensor):
            t, kind = _local(obj), _kind(obj)
            self.found.sharded = self.found.sharded or kind is not _PLAIN_KIND
        elif type(obj) is OrderedDict:  # a module's state dict: kept as a dict (its ``_metadata``
            return dict, (dict(obj),)  # is the live target's at restore); half the pickling time
        else:
            return NotImplemented
        found = self.found
        cursor, nbytes = found.cursor, t.nbytes
        args = (cursor, nbytes, t.dtype, tuple(t.shape), kind)
        found.cursor = cursor + -(-nbytes // ALIGN) * ALIGN
        # Plain tuples here (a NamedTuple costs a microsecond more each, every snapshot).
        found.tensors.append((args, t))
        found.layout.append(args[2:])
        if nbytes:
            found.sources.append(t)
            found.cpu = found.cpu and t.is_cpu
        return TensorRef, args


def misfit(saved: Any, target: Any, path: str = "") -> str | None:
    """Why the saved skeleton cannot fill ``target`` (``targets(state)``), or None: the same
    keys, list lengths and, for each tensor, dtype, local shape and kind. Plain values may
    differ (they are the saved state). Run once per restore, so it may walk in Python."""
    if isinstance(saved, TensorRef):
        if not isinstance(target, torch.Tensor):
            return f"{path or '.'}: a tensor was saved, the state has {type(target).__name__}"
        t = _local(target)
        have = (t.dtype, tuple(t.shape), _kind(target))
        if (have[0], have[1], _split(have[2])) == (saved[2], tuple(saved[3]), _split(saved[4])):
            return None
        return f"{path}: saved {tuple(saved[2:])}, the state has {have}"
    if isinstance(saved, dict):
        if not isinstance(target, dict) or saved.keys() != target.keys():  # order aside: filled by key
            return f"{path or '.'}: keys differ"
        return next((m for k in saved if (m := misfit(saved[k], target[k], f"{path}/{k}"))), None)
    if isinstance(saved, (list, tuple)):
        if not isinstance(target, (list, tuple)) or len(saved) != len(target):
            return f"{path or '.'}: lengths differ"
        return next((m for i, (s, t) in enumerate(zip(saved, target, strict=True)) if (m := misfit(s, t, f"{path}/{i}"))),
                    None)
    if isinstance(target, (torch.Tensor, dict)):
        return f"{path or '.'}: the state has a {type(target).__name__} where a plain value was saved"
    return None


class Views:
    """Typed views of one slot for one layout, made once and reused while neither changes."""

    def __init__(self) -> None:
        self._key: tuple = ()
        self._data: torch.Tensor | None = None  # held, not its id(): a freed tensor's id is reused
        self._views: list[torch.Tensor] = []

    def of(self, cap: Capture, data: torch.Tensor, base: int) -> list[torch.Tensor]:
        key = (cap.digest, base)
        if key != self._key or data is not self._data:
            self._views = [_typed(data, base, ref) for ref, _ in cap.tensors if ref[1]]
            self._key, self._data = key, data
        return self._views


def write(cap: Capture, data: torch.Tensor, base: int, views: Views) -> None:
    """Copy the tensors, then the pickled skeleton, into ``data`` from ``base``."""
    targets = views.of(cap, data, base)  # one per tensor with bytes, as ``cap.sources``
    if cap.sources and cap.cpu:
        with torch.no_grad():  # one call into C++ for every tensor (a loop of copy_ cost ~2 us each)
            copy_all(targets, cap.sources)
    else:
        for view, t in zip(targets, cap.sources, strict=True):
            view.copy_(t.detach())
    start = base + cap.data_len
    data[start:start + len(cap.skeleton)].copy_(torch.frombuffer(bytearray(cap.skeleton), dtype=torch.uint8))


def read_skeleton(data: torch.Tensor, base: int, data_len: int, skeleton_len: int) -> dict[str, Any]:
    start = base + data_len
    return unpack(data[start:start + skeleton_len].numpy().tobytes())


def restore_into(state: dict[str, Any], trees: dict[str, Any], skeleton: dict[str, Any],
                 data: torch.Tensor, base: int) -> None:
    """Fill ``trees`` (``targets(state)``, same layout digest) from the snapshot, then load
    each entry from its filled state dict."""
    with torch.no_grad():
        for key, saved in skeleton.items():
            trees[key] = _fill(trees[key], saved, data, base)
    load_entries(state, trees)


def load_entries(state: dict[str, Any], trees: dict[str, Any]) -> None:
    """Load each entry of ``state`` from its filled state dict in ``trees``."""
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


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # exact types, not subclasses such as DTensor
_PLAIN_KIND = ("tensor",)


def _kind(t: torch.Tensor) -> tuple:
    """What besides dtype and local shape must match: a DTensor's global shape and placements."""
    return ("dtensor", tuple(t.shape), tuple(t.placements)) if isinstance(t, DTensor) else _PLAIN_KIND


def _split(kind: tuple) -> tuple:
    """What of a kind fixes which bytes a rank holds: ``Replicate`` placements aside (they say
    how many replicas there are, which a mesh's replicate degree changes: an HSDP shard on a
    2-D (replicate, shard) mesh holds the bytes of the same shard on the 1-D shard mesh)."""
    if kind[0] != "dtensor" or not any(isinstance(p, Replicate) for p in kind[2]):
        return kind
    return (kind[0], kind[1], tuple(p for p in kind[2] if not isinstance(p, Replicate)))


def _typed(data: torch.Tensor, base: int, ref: tuple) -> torch.Tensor:
    """The slot's bytes of ``ref`` (a ``TensorRef`` or its fields) seen as its dtype and shape
    (offsets are aligned)."""
    offset, nbytes, dtype, shape = ref[:4]
    start = base + offset
    return data[start:start + nbytes].view(dtype).view(shape)


_DIGESTS: dict[tuple, bytes] = {}  # a process sees one or two layouts: hashed once each


def _digest(layout: tuple) -> bytes:
    """sha256 of the layout's text (the same in every process), each kind as ``_split`` sees
    it (so a mesh's state digests the same at any replicate degree; the digests of plain and
    1-D sharded state are unchanged by that); looking the tuple up costs a few microseconds a
    snapshot, formatting and hashing it a few hundred."""
    digest = _DIGESTS.get(layout)
    if digest is None:
        if len(_DIGESTS) >= 8:
            _DIGESTS.clear()
        text = repr(tuple((*entry[:-1], _split(entry[-1])) for entry in layout))
        digest = _DIGESTS[layout] = hashlib.sha256(text.encode()).digest()
    return digest
