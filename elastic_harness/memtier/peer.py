"""What the ranks of a restore exchange, as raw tensors: offers, flags, a snapshot's bytes.

Nothing received is unpickled (the checkpoint group's gloo connections are not
authenticated). Offers and flags travel as fixed-size int64 tensors (``Wire.gather``); a
snapshot travels as its tensor bytes (sent straight from the sender's slot, received
straight into the receiver's) plus its skeleton in a JSON form (``encode_skeleton``) that
holds only containers, numbers, strings, dtypes and ``TensorRef`` fields: decoding it
builds nothing else, and the receiver then checks it against its own live state
(``snapshot.misfit``) before any byte is used.

``restore_rules`` reads the job's layout (``runtime.topology``'s value, as it is: ``Layout``
says what of it the tier reads) into the rules ``choose`` follows: a full replica on every
rank (DDP) restores at another world size or rank; 1-D FSDP reshards every old rank's
snapshot; a mesh's replicas restore by their coordinate in its plane at another replicate
degree. ``portable`` says whether the state lets one rank's snapshot stand for another's.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from elastic_harness.memtier.choose import Offer
from elastic_harness.memtier.slots import MAX_PLANE, plane_of
from elastic_harness.memtier.snapshot import TensorRef, Unsupported

MAX_OFFERS = 4  # slots per rank that take part (the agent makes 2)
# step, world size, rank, replicated, digest as 4 int64, generation, buddy, coordinate, plane
_FIELDS = 11 + MAX_PLANE
MAX_SKELETON = 64 << 20  # a JSON skeleton larger than this is refused (a bogus length)


@dataclass
class Wire:
    """The collectives of a restore, on the checkpoint group (every rank calls ``gather`` in
    the same order; ``send``/``recv`` pair up between one sender and one receiver)."""

    gather: Callable[[list[int]], list[list[int]]]  # every rank's equally long list, rank order
    send: Callable[[torch.Tensor, int], None]
    recv: Callable[[torch.Tensor, int], None]
    # A restore's tensor bytes (tag 0, as ``send``/``recv``): post a send or a receive and
    # return its work (``wait()``), so several pieces are in flight (``post_chunked``).
    # None: the blocking ``send``/``recv``, one piece after another.
    post_send: Callable[[torch.Tensor, int], Any] | None = None
    post_recv: Callable[[torch.Tensor, int], Any] | None = None

    @classmethod
    def of(cls, group: Any, world_size: int) -> Wire:
        """The wire over ``group`` (None: the default group)."""
        import torch.distributed as dist

        def gather(values: list[int]) -> list[list[int]]:
            t = torch.tensor(values, dtype=torch.int64)
            out = [torch.empty_like(t) for _ in range(world_size)]
            dist.all_gather(out, t, group=group)
            return [o.tolist() for o in out]

        return cls(gather,
                   lambda t, dst: dist.send(t, group=group, group_dst=dst),
                   lambda t, src: dist.recv(t, group=group, group_src=src),
                   post_send=lambda t, dst: dist.isend(t, group=group, group_dst=dst),
                   post_recv=lambda t, src: dist.irecv(t, group=group, group_src=src))


CHUNK = 8 << 20  # a snapshot's bytes travel in pieces of this size, all posted at once


def pieces(size: int, chunk: int | None = None) -> list[tuple[int, int]]:
    """Pure: ``[start, end)`` of each piece of ``size`` bytes (both sides cut the same way)."""
    chunk = chunk or CHUNK
    return [(a, min(a + chunk, size)) for a in range(0, size, chunk)]


def post_chunked(wire: Wire, data: torch.Tensor, receivers: list[int]) -> list[Any]:
    """Post ``data`` (uint8) to every receiver, in ``pieces``; the works to wait for
    (``wait_all``). Gloo moves them from its own threads, to several receivers at once
    (measured on 2 loopback ranks, 100 MB: 1.4 GB/s in one message, 1.9 GB/s in 8 MB
    pieces), while the caller goes on. With blocking sends only: sent here, nothing to wait for."""
    if wire.post_send is None:
        for r in receivers:
            for a, b in pieces(data.numel()):
                wire.send(data[a:b], r)
        return []
    return [wire.post_send(data[a:b], r) for r in receivers for a, b in pieces(data.numel())]


def wait_all(works: list[Any]) -> None:
    """Wait for every posted send or receive; one whose peer died raises (as a blocking one would)."""
    for w in works:
        w.wait()


def recv_chunked(wire: Wire, data: torch.Tensor, src: int) -> None:
    """``post_chunked``'s other side: ``data`` (uint8, the size announced) from ``src``."""
    if wire.post_recv is None:
        for a, b in pieces(data.numel()):
            wire.recv(data[a:b], src)
        return
    wait_all([wire.post_recv(data[a:b], src) for a, b in pieces(data.numel())])


def failing(wire: Wire, bad: bool) -> list[int]:
    """Collective: the ranks for which ``bad`` holds (every rank learns the same list)."""
    return [r for r, (b,) in enumerate(wire.gather([int(bad)])) if b]


def send_piece(wire: Wire, receiver: int, piece: tuple | None) -> str | None:
    """Send an old rank's snapshot (``piece``: skeleton, bytes, base, its JSON or None) to
    ``receiver``: an announcement (sent or not, tensor bytes, JSON bytes), then the skeleton
    as JSON and the tensor bytes. Why it could not be sent (only a "not sent" goes), or None."""
    raw, problem = b"", None
    if piece is not None:
        try:
            raw = piece[3] if piece[3] is not None else encode_skeleton(piece[0])
        except Unsupported as e:
            problem = str(e)
    size = data_len(piece[0]) if raw else 0
    wire.send(torch.tensor([int(bool(raw)), size, len(raw)], dtype=torch.int64), receiver)
    if raw:
        wire.send(torch.frombuffer(bytearray(raw), dtype=torch.uint8), receiver)
        if size:
            wire.send(piece[1][piece[2]:piece[2] + size], receiver)
    return problem


def receive_piece(wire: Wire, sender: int, r: int) -> tuple[tuple | None, str]:
    """Old rank ``r``'s snapshot from ``sender`` (``send_piece``): (skeleton, bytes, 0, None),
    or None and why not. A length no sender of ours announces raises."""
    meta = torch.zeros(3, dtype=torch.int64)
    wire.recv(meta, sender)
    ok, size, json_len = (int(v) for v in meta)
    if not ok:
        return None, f"rank {sender} could not send old rank {r}'s snapshot"
    if not 0 < json_len <= MAX_SKELETON or size < 0:
        raise RuntimeError(f"rank {sender} announced a snapshot of {size}+{json_len} bytes")
    raw = torch.empty(json_len, dtype=torch.uint8)
    wire.recv(raw, sender)
    data = torch.empty(size, dtype=torch.uint8)
    if size:
        wire.recv(data, sender)
    try:
        skeleton = decode_skeleton(raw.numpy().tobytes())
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        return None, f"old rank {r}'s skeleton from rank {sender} is malformed ({e!r:.200})"
    if data_len(skeleton) > size:
        return None, f"old rank {r}'s skeleton from rank {sender} names more bytes than it sent"
    return (skeleton, data, 0, None), ""


def data_len(skeleton: Any) -> int:
    """The tensor bytes a skeleton's references span (the end of the last one)."""
    if isinstance(skeleton, TensorRef):
        return skeleton.offset + skeleton.nbytes
    if isinstance(skeleton, dict):
        return max((data_len(v) for v in skeleton.values()), default=0)
    if isinstance(skeleton, (list, tuple)):
        return max((data_len(v) for v in skeleton), default=0)
    return 0


def _per_rank_entries(state_keys: Any) -> bool:
    """Did a script register entries of its own (``checkpoint.entries``)? They may differ per
    rank, so no layout rule may take one rank's snapshot for another's."""
    from elastic_harness.checkpoint.entries import EXTRA_PREFIX

    return any(str(k).startswith(EXTRA_PREFIX) for k in state_keys)


class Layout(Protocol):
    """What the tier reads of the job's parallel layout (``runtime.topology.Topology``)."""

    kind: str  # "ddp" (replicas), "fsdp" (shards of the elastic dimension) or "mesh"
    plane: tuple[int, ...]  # the degrees that stay as the elastic dimension resizes

    def coordinate(self, rank: int | None = None) -> int: ...


def portable(layout: Layout, model: Any, state_keys: Any) -> bool:
    """May one rank's snapshot stand for another's as ``layout`` says (a replica's for a
    replica's, old shards resharded)? Not when a script registered entries of its own
    beyond model, optimizer, scheduler, scaler and train position (they may differ per
    rank), nor under ``ddp`` with a model that is not a ``DistributedDataParallel`` (nothing
    keeps a bare model's replicas the same)."""
    from torch.nn.parallel import DistributedDataParallel

    from elastic_harness.torchcompat.nn import unwrap_compiled

    if _per_rank_entries(state_keys):
        return False
    inner = unwrap_compiled(model)
    return layout.kind != "ddp" or isinstance(inner, DistributedDataParallel)


@dataclass(frozen=True)
class Rules:
    """Which restores across ranks and world sizes a generation may make (``choose``)."""

    replicated: bool = False  # every rank's state is the whole job's (DDP)
    sharded: bool = False  # each rank's state is its shard of the elastic dimension (1-D FSDP)
    mesh: tuple[int, ...] | None = None  # a mesh's plane: its replicas restore by coordinate
    coordinates: tuple[int, ...] = ()  # with ``mesh``: each rank's coordinate in it


def restore_rules(layout: Layout | None, world_size: int, portable: bool = True) -> Rules:
    """The rules of ``layout`` over ``world_size`` ranks (None, or a state that is not
    ``portable``: none; each rank restores only its own snapshot at the same world size)."""
    if layout is None or not portable:
        return Rules()
    if layout.kind == "mesh" and len(layout.plane) <= MAX_PLANE:
        return Rules(mesh=tuple(layout.plane), coordinates=tuple(layout.coordinate(r) for r in range(world_size)))
    return Rules(replicated=layout.kind == "ddp", sharded=layout.kind == "fsdp")


# ----- offers as int64 ------------------------------------------------------------------

def encode_offers(offers: list[Offer]) -> list[int]:
    """Pure: a fixed-length list of int64 values (count, then ``_FIELDS`` per offer)."""
    out = [min(len(offers), MAX_OFFERS)]
    for o in offers[:MAX_OFFERS]:
        d = o.digest.ljust(32, b"\0")[:32]
        out += [o.step, o.world_size, o.rank, int(o.replicated),
                *(int.from_bytes(d[i:i + 8], "little", signed=True) for i in range(0, 32, 8)),
                o.generation, int(o.buddy), o.coordinate, *o.mesh, *[0] * (MAX_PLANE - len(o.mesh))]
    return out + [0] * (1 + MAX_OFFERS * _FIELDS - len(out))


def decode_offers(values: list[int]) -> list[Offer]:
    """Pure: ``encode_offers``'s inverse; a malformed list is no offers."""
    if len(values) != 1 + MAX_OFFERS * _FIELDS or not 0 <= values[0] <= MAX_OFFERS:
        return []
    out = []
    for i in range(values[0]):
        f = values[1 + i * _FIELDS:1 + (i + 1) * _FIELDS]
        digest = b"".join(v.to_bytes(8, "little", signed=True) for v in f[4:8])
        out.append(Offer(f[0], f[1], f[2], digest, bool(f[3]), f[8], bool(f[9]), plane_of(f[11:]), f[10]))
    return out


# ----- the skeleton as JSON ---------------------------------------------------------------

def encode_skeleton(skeleton: Any) -> bytes:
    """Pure: the skeleton (``snapshot.read_skeleton``) as JSON; ``Unsupported`` for any value
    outside containers, numbers, strings, dtypes and plain-tensor ``TensorRef``s."""
    return json.dumps(_enc(skeleton), separators=(",", ":")).encode()


class SkeletonEncoder:
    """``encode_skeleton`` for the snapshots of one rank, one after another, from their
    entries' pickles (``snapshot.Capture.parts``, our own bytes): an entry whose pickle is
    the same bytes as last time keeps its JSON, the others are unpickled and encoded again.
    Between two steps usually only the train position changes: a buddy copy encodes a few
    values instead of every tensor reference. Comparing the entries' values instead (after
    unpickling the whole skeleton) cost ~0.25 ms a copy for the bench's FSDP2 MLP, a third
    of what a copy held the training thread."""

    def __init__(self) -> None:
        self._parts: dict[str, tuple[bytes, bytes]] = {}

    def encode(self, parts: dict[str, bytes]) -> bytes:
        out, kept = [], {}
        for key, pickled in parts.items():
            old = self._parts.get(key)
            raw = old[1] if old is not None and old[0] == pickled \
                else json.dumps(_enc(pickle.loads(pickled)), separators=(",", ":")).encode()  # our own bytes
            kept[key] = (pickled, raw)
            out.append(b"[" + json.dumps(key).encode() + b"," + raw + b"]")
        self._parts = kept
        return b'{"d":[' + b",".join(out) + b"]}"


def decode_skeleton(raw: bytes) -> Any:
    """Pure: ``encode_skeleton``'s inverse; ``ValueError`` for anything it did not write."""
    return _dec(json.loads(raw.decode()))


def _enc(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, TensorRef):
        ref = [v.offset, v.nbytes, _dtype_name(v.dtype), list(v.shape)]
        return {"r": ref} if tuple(v.kind) == ("tensor",) else {"s": [*ref, *_enc_kind(v.kind)]}
    if isinstance(v, torch.dtype):
        return {"dt": _dtype_name(v)}
    if isinstance(v, dict):
        if not all(type(k) in (str, int) for k in v):
            raise Unsupported("a dict key that is not a str or an int")
        return {"d": [[k, _enc(x)] for k, x in v.items()]}
    if isinstance(v, list):
        return {"l": [_enc(x) for x in v]}
    if type(v) is tuple:
        return {"t": [_enc(x) for x in v]}
    raise Unsupported(f"a {type(v).__name__} in the state is not sent to peers")


def _dec(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, dict) and len(v) == 1:
        (tag, x), = v.items()
        if tag == "d" and isinstance(x, list) and all(isinstance(p, list) and len(p) == 2 for p in x):
            if not all(type(k) in (str, int) for k, _ in x):
                raise ValueError("a bad dict key")
            return {k: _dec(val) for k, val in x}
        if tag == "l" and isinstance(x, list):
            return [_dec(i) for i in x]
        if tag == "t" and isinstance(x, list):
            return tuple(_dec(i) for i in x)
        if tag == "dt":
            return _dtype(x)
        if tag == "r" and isinstance(x, list) and len(x) == 4:
            return TensorRef(*_dec_ref(x), ("tensor",))
        if tag == "s" and isinstance(x, list) and len(x) == 6:
            return TensorRef(*_dec_ref(x[:4]), _dec_kind(x[4], x[5]))
    raise ValueError("not a skeleton this harness wrote")


def _dec_ref(x: list) -> tuple:
    offset, nbytes, dtype, shape = x
    if not (type(offset) is int and type(nbytes) is int and offset >= 0 and nbytes >= 0
            and isinstance(shape, list) and all(type(s) is int and s >= 0 for s in shape)):
        raise ValueError("a bad tensor reference")
    return offset, nbytes, _dtype(dtype), tuple(shape)


_KINDS: dict[tuple, list] = {}  # a layout has a few kinds, encoded at every buddy copy: kept


def _enc_kind(kind: tuple) -> list:
    """A DTensor's kind (``snapshot._kind``: global shape, placements) as [shape, names]:
    ``S<dim>`` (``Shard``) or ``R`` (``Replicate``); any other placement is not sent. Kept
    per kind (ints and placements, equal only when the same): ~4 us each otherwise, 18 of
    them in every copy of the bench's FSDP2 MLP."""
    try:
        out = _KINDS.get(kind)
    except TypeError:  # a placement that cannot be hashed: refused below
        return _enc_kind_new(kind)
    if out is None:
        if len(_KINDS) >= 256:
            _KINDS.clear()
        out = _KINDS[kind] = _enc_kind_new(kind)
    return out


def _enc_kind_new(kind: tuple) -> list:
    from torch.distributed.tensor import Replicate, Shard

    _, shape, placements = kind
    names = []
    for p in placements:
        if type(p) is Shard:
            names.append(f"S{p.dim}")
        elif type(p) is Replicate:
            names.append("R")
        else:
            raise Unsupported(f"a {type(p).__name__} placement is not sent to peers")
    return [list(shape), names]


def _dec_kind(shape: Any, names: Any) -> tuple:
    from torch.distributed.tensor import Replicate, Shard

    if not (isinstance(shape, list) and all(type(s) is int and s >= 0 for s in shape)
            and isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise ValueError("a bad sharded tensor reference")
    placements = []
    for n in names:
        if n == "R":
            placements.append(Replicate())
        elif n[:1] == "S" and n[1:].isdigit() and len(n) < 6:
            placements.append(Shard(int(n[1:])))
        else:
            raise ValueError(f"not a placement: {n!r:.20}")
    return ("dtensor", tuple(shape), tuple(placements))


def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _dtype(name: Any) -> torch.dtype:
    d = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(d, torch.dtype):
        raise ValueError(f"not a dtype: {name!r:.40}")
    return d
