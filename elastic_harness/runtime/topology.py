"""The parallel layout of one worker generation: one value, built once at start, passed down.

"World size" is the number of processes; the data-parallel degree is how many different
shares of the global batch a step reads. They are different words for different numbers:
under tensor parallelism the ranks of one tensor group read the same samples.

Mesh dimensions, outer to inner: ``replicate x shard x tensor`` (torchtitan's HSDP + TP
order: tensor innermost, so a tensor group is consecutive ranks of one node). Ranks are laid
out row-major, ``rank = (r * shard + s) * tensor + t``:

- ``replicate``: full copies of the (possibly sharded) model, each reading its own samples;
- ``shard``: FSDP2 shards, each reading its own samples too;
- ``tensor``: tensor-parallel ranks, which read the same samples.

So the data-parallel degree is ``replicate * shard`` and a rank's data-parallel rank is
``r * shard + s``. The elastic dimension is the one that grows and shrinks as nodes come and
go: ``ddp`` (replicate = world) and ``fsdp`` (shard = world: DCP reshards the state) resize
their only dimension; a mesh resizes ``replicate`` while its inner dimensions stay within a
node, so they must divide ``nproc_per_node``.

Pure: no torch, no ``torch.distributed`` call, no environment read. ``build`` takes plain
numbers (``from_env`` the worker's ``launch.env`` values) and validates: a layout that cannot
fit raises ``SpecError`` naming ``parallelism`` and the fix; that decision lives in
``spec.layout`` (the spec checks every node count of the job with it, so a job that
validates also builds here). The ``DeviceMesh`` built from this value: ``runtime.mesh``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from elastic_harness.spec.layout import DIMS, mesh_degrees, normalize


@dataclass(frozen=True)
class Topology:
    """One process's view of the layout: the whole mesh, and this process's ``rank`` in it.

    Methods that take ``rank`` answer for any rank (default: this one)."""

    world_size: int
    nproc_per_node: int
    nodes: int
    replicate: int
    shard: int
    tensor: int
    elastic: str  # the dimension that follows the node count: one of DIMS
    kind: str  # "ddp", "fsdp" or "mesh": what the spec named
    rank: int = 0

    # ----- construction ----------------------------------------------------------------
    @classmethod
    def build(cls, world_size: int, nproc_per_node: int, nodes: int, layout: str | Mapping[str, Any],
              rank: int = 0) -> Topology:
        """The layout ``layout`` (``ddp``, ``fsdp`` or a mesh mapping) over ``world_size``
        processes, ``nproc_per_node`` on each of ``nodes``; validated."""
        if world_size < 1 or nproc_per_node < 1 or nodes < 1:
            raise ValueError(f"world_size {world_size}, nproc_per_node {nproc_per_node}, nodes {nodes}: "
                             "each must be at least 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a world of {world_size}")
        common = dict(world_size=world_size, nproc_per_node=nproc_per_node, nodes=nodes, rank=rank)
        if layout == "ddp":
            return cls(replicate=world_size, shard=1, tensor=1, elastic="replicate", kind="ddp", **common)
        if layout == "fsdp":
            return cls(replicate=1, shard=world_size, tensor=1, elastic="shard", kind="fsdp", **common)
        if isinstance(layout, Mapping):
            replicate, shard, tensor = mesh_degrees(layout, world_size, nproc_per_node, nodes)
            return cls(replicate=replicate, shard=shard, tensor=tensor, elastic="replicate", kind="mesh",
                       **common)
        normalize(layout)  # raises, naming the fix
        raise AssertionError(f"{layout!r} passed spec.layout")

    @classmethod
    def from_env(cls, env: Any, layout: str | Mapping[str, Any]) -> Topology:
        """From a ``launch.env.WorkerEnv`` (its plain values; nothing is read here)."""
        nodes = env.group_world_size or max(1, env.world_size // max(env.local_world_size, 1))
        return cls.build(env.world_size, env.local_world_size, nodes, layout, rank=env.rank)

    # ----- the mesh ----------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int, int]:
        """The degrees of ``DIMS``, outer to inner."""
        return (self.replicate, self.shard, self.tensor)

    def degree(self, dim: str) -> int:
        return self.shape[_index(dim)]

    def coords(self, rank: int | None = None) -> tuple[int, int, int]:
        """``(r, s, t)`` of ``rank`` in the mesh."""
        rank = self._rank(rank)
        r, rest = divmod(rank, self.shard * self.tensor)
        s, t = divmod(rest, self.tensor)
        return (r, s, t)

    def rank_at(self, r: int, s: int, t: int) -> int:
        return (r * self.shard + s) * self.tensor + t

    def group(self, dim: str, rank: int | None = None) -> tuple[int, ...]:
        """The ranks of ``rank``'s group along ``dim``: those that differ from it in ``dim``
        only, in order of their coordinate there."""
        i = _index(dim)
        at = list(self.coords(rank))
        members = []
        for k in range(self.shape[i]):
            at[i] = k
            members.append(self.rank_at(*at))
        return tuple(members)

    def groups(self, dim: str) -> tuple[tuple[int, ...], ...]:
        """Every group along ``dim``, each once, ordered by its lowest rank."""
        seen = {self.group(dim, rank) for rank in range(self.world_size)}
        return tuple(sorted(seen))

    # ----- data parallelism --------------------------------------------------------------
    @property
    def dp_degree(self) -> int:
        """How many different shares of the global batch a step reads."""
        return self.replicate * self.shard

    def dp_rank(self, rank: int | None = None) -> int:
        """Which share ``rank`` reads; the ranks of one tensor group read the same share."""
        r, s, _ = self.coords(rank)
        return r * self.shard + s

    @property
    def ranks_per_share(self) -> int:
        """How many ranks read each share (a tensor group): each counts the same samples' loss."""
        return self.world_size // self.dp_degree

    # ----- what stays while the elastic dimension resizes -------------------------------
    @property
    def plane(self) -> tuple[int, ...]:
        """The degrees of every dimension but the elastic one, outer to inner: what a join or
        a node loss leaves as it was (a mesh's shard and tensor degrees)."""
        return tuple(d for dim, d in zip(DIMS, self.shape, strict=True) if dim != self.elastic)

    def coordinate(self, rank: int | None = None) -> int:
        """``rank``'s place in the ``plane`` (row-major): the ranks of one coordinate, one per
        elastic index, hold the same part of the state (a mesh's replicas)."""
        at, out = self.coords(rank), 0
        for dim, degree, c in zip(DIMS, self.shape, at, strict=True):
            if dim != self.elastic:
                out = out * degree + c
        return out

    def _rank(self, rank: int | None) -> int:
        rank = self.rank if rank is None else rank
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        return rank


def _index(dim: str) -> int:
    if dim not in DIMS:
        raise ValueError(f"unknown mesh dimension {dim!r}: one of {', '.join(DIMS)}")
    return DIMS.index(dim)
