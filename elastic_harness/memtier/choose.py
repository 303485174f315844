"""Pure: where a new worker generation restores from: its own memory, a peer's, or storage.

Every rank reads its own slots' headers (``Offer``: step, the world size and rank that wrote
it, the layout digest, replicated or not); the offers are gathered once, and every rank
computes the same ``Plan`` from them:

- ``memory``, same layout: every rank holds a snapshot of the step that it wrote itself at
  this world size (a worker crash). Works for sharded state too: each rank reads its shard.
- ``memory`` or ``peer``, replicated: the layout is replicated (DDP: each snapshot holds the
  whole model and optimizer, and the data position is world-size-free), so any snapshot of a
  step is every rank's state whatever world size and rank wrote it. The step is the newest
  one any rank holds; the ranks holding it read their own slot, the others (a node that
  joined, a lost slot) receive it from a holder (``peer``). Only when the job's layout is
  replicated now and every offer of that step was written replicated with one digest.
- ``buddy``, sharded (FSDP): each rank also holds a copy of another node's newest snapshot
  (``memtier.buddy``: the ring), so after a node is lost every old rank's snapshot of a step
  may still be in some survivor's memory, as its own or as a buddy copy. The step is the
  newest one whose pieces, all written by one generation at one world size, cover every rank
  of that world size (``_cover``); the ranks then reshard them in memory (``memtier.reshard``)
  to the new world size. A half-written or half-received copy is unpublished, so never offered.
- ``memory`` or ``peer``, a mesh whose replicas grew or shrank (``mesh``: the degrees of the
  job's plane, every dimension but the elastic one, unchanged): each replica holds the same
  state, a rank's being that of its coordinate in the plane (``runtime.topology``'s
  ``plane`` and ``coordinate``: every offer carries its writer's). The step is the newest one
  whose snapshots, all written by one generation at one world size with this plane, cover
  every coordinate with one layout digest each (``_coordinates``); each rank reads its own
  slot when it holds its coordinate's snapshot, else receives it from a holder of that
  coordinate (``peer``). A storage checkpoint newer than that step wins (``tier``).
- ``storage`` otherwise: nobody holds a snapshot, the layouts disagree, the newest step has
  offers of different layouts, a mesh coordinate no survivor holds, a mesh whose plane
  changed (DCP reshards), sharded state whose pieces no longer cover every old rank (a
  node and the node holding its buddy copy both lost), or any doubt.

Never mixes steps: every rank restores the one step chosen, or none does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MEMORY, PEER, BUDDY, STORAGE = "memory", "peer", "buddy", "storage"


@dataclass(frozen=True)
class Offer:
    """A published snapshot one rank holds in its own slots."""

    step: int
    world_size: int  # of the generation that wrote it
    rank: int  # that wrote it
    digest: bytes  # of its tensors' layout
    replicated: bool
    generation: int = 0  # the worker generation that wrote it (0: not known, never a buddy piece)
    buddy: bool = False  # a buddy copy: ``rank``'s snapshot, held by another rank
    # A mesh layout's snapshot: the writer's plane (empty: not a mesh's) and its coordinate there
    mesh: tuple[int, ...] = ()
    coordinate: int = 0


@dataclass(frozen=True)
class Plan:
    source: str  # MEMORY, PEER, BUDDY or STORAGE
    step: int | None = None
    holders: tuple[int, ...] = ()  # ranks that restore from their own slot
    same_layout: bool = False  # every rank reads the snapshot it wrote at this world size
    digest: bytes = b""  # replicated: the layout every offer of ``step`` has
    reason: str = ""  # why storage, for the warning
    # BUDDY: the old world size, the generation, and per old rank the rank that provides its
    # snapshot (``providers[r]``) and that snapshot's layout digest (``digests[r]``)
    saved_world_size: int = 0
    generation: int = 0
    providers: tuple[int, ...] = ()
    digests: tuple[bytes, ...] = ()
    # A mesh's coordinate restore (MEMORY or PEER): the plane's degrees, then per new rank its
    # coordinate and the rank whose own slot it restores from (itself: a holder);
    # ``saved_world_size``, ``generation`` are the writers', ``digests`` one per coordinate.
    mesh: tuple[int, ...] = ()
    coordinates: tuple[int, ...] = ()
    feeds: tuple[int, ...] = ()

    def coordinate(self, rank: int) -> int:
        """A mesh plan: ``rank``'s coordinate in the plane."""
        return self.coordinates[rank]

    def senders(self, world_size: int) -> dict[int, int]:
        """``{receiver: sender}``: each rank not holding the step receives it from a holder,
        the receivers spread over the holders in rank order (a mesh plan: over the holders of
        the receiver's coordinate, ``feeds``)."""
        if self.source == STORAGE or not self.holders:
            return {}
        if self.mesh:
            return {r: f for r, f in enumerate(self.feeds) if f != r}
        held = set(self.holders)
        receivers = [r for r in range(world_size) if r not in held]
        return {r: self.holders[i % len(self.holders)] for i, r in enumerate(receivers)}


def offers_of(headers: Sequence[Any], buddy: bool = False) -> list[Offer]:
    """The published snapshots among a rank's slot headers (``slots.Header`` or None): a
    slot being written (or whose writer was killed) is not published. ``buddy``: these are
    its buddy slots (copies of another rank's snapshot)."""
    return [Offer(h.step, h.world_size, h.rank, h.digest, h.replicated, h.generation, buddy, h.mesh, h.coordinate)
            for h in headers if h is not None and h.published]


def choose(offers: Sequence[Sequence[Offer]], *, world_size: int, replicated: bool,
           sharded: bool = True, mesh: tuple[int, ...] | None = None, coordinates: Sequence[int] = ()) -> Plan:
    """The plan from every rank's offers (``offers[r]``: rank ``r``'s, ``len == world_size``);
    ``replicated``: the job's layout now is replicated (``peer.restore_rules``);
    ``sharded``: it is 1-D FSDP, the only layout whose pieces are resharded in memory
    (``BUDDY``); ``mesh``: the degrees of the job's mesh plane, with ``coordinates[r]`` rank
    ``r``'s coordinate there: its replicas restore by coordinate at any world size. Any
    other layout at another world size restores from storage, which DCP reshards."""
    if len(offers) != world_size:
        return Plan(STORAGE, reason=f"offers of {len(offers)} ranks, world size {world_size}")
    everyone = offers
    cover = _cover(everyone) if sharded and not replicated else None
    offers = [[o for o in mine if not o.buddy] for mine in everyone]  # the other sources: own snapshots
    exact = _same_layout_step(offers, world_size)
    if cover is not None and (exact is None or cover.step > exact):
        return cover
    rep = _replicated_step(offers) if replicated else None
    if isinstance(rep, str):  # the newest replicated step is in doubt: not even an older one
        return Plan(STORAGE, reason=rep)
    coords = _coordinates(offers, world_size, mesh, coordinates) if mesh and not replicated else None
    if coords is not None and (exact is None or coords.step > exact):
        return coords
    if exact is not None and (rep is None or exact >= rep[0]):
        return Plan(MEMORY, exact, tuple(range(world_size)), same_layout=True)
    if rep is not None:
        step, digest, holders = rep
        source = MEMORY if len(holders) == world_size else PEER
        return Plan(source, step, holders, digest=digest)
    return Plan(STORAGE, reason=_storage_reason(everyone, offers, world_size, replicated, mesh, coordinates))


def _storage_reason(everyone: Sequence[Sequence[Offer]], own: Sequence[Sequence[Offer]], world_size: int,
                    replicated: bool, mesh: tuple[int, ...] | None, coordinates: Sequence[int]) -> str:
    """Why no memory source serves (``everyone``'s offers, ``own`` without the buddy copies)."""
    if not any(everyone):
        return "no rank holds a snapshot"
    if mesh and not replicated:
        return _coordinates_missing(own, mesh, coordinates)
    if not replicated:
        return _uncovered(everyone) or ("the state is not replicated (FSDP, or per-rank entries) and not "
                                        f"every rank holds its own snapshot at world size {world_size}")
    return "no snapshot of a replicated layout"


def _pieces(offers: Sequence[Sequence[Offer]]) -> dict[tuple[int, int, int], dict[int, list[tuple[int, Offer]]]]:
    """Sharded offers by (step, old world size, generation): per old rank, who holds it."""
    out: dict[tuple[int, int, int], dict[int, list[tuple[int, Offer]]]] = {}
    for holder, mine in enumerate(offers):
        for o in mine:
            if o.replicated or not o.generation or not 0 <= o.rank < o.world_size:
                continue
            out.setdefault((o.step, o.world_size, o.generation), {}).setdefault(o.rank, []).append((holder, o))
    return out


def _cover(offers: Sequence[Sequence[Offer]]) -> Plan | None:
    """BUDDY: the newest (step, world size, generation) whose pieces cover every old rank,
    with one layout digest per old rank; a provider per old rank (one holding it as its own
    snapshot first, then the lowest rank). None if no step is covered."""
    for (step, old, gen), by_rank in sorted(_pieces(offers).items(), reverse=True):
        if len(by_rank) != old:
            continue
        if any(len({o.digest for _, o in held}) != 1 for held in by_rank.values()):
            continue  # two copies of one rank's snapshot that disagree: not this step
        providers = tuple(min(by_rank[r], key=lambda p: (p[1].buddy, p[0]))[0] for r in range(old))
        holders = tuple(sorted({h for held in by_rank.values() for h, _ in held}))
        return Plan(BUDDY, step, holders, saved_world_size=old, generation=gen, providers=providers,
                    digests=tuple(by_rank[r][0][1].digest for r in range(old)))
    return None


def _uncovered(offers: Sequence[Sequence[Offer]]) -> str:
    """Why no sharded step is covered, naming the newest one's missing ranks ("" if none)."""
    pieces = _pieces(offers)
    if not pieces:
        return ""
    (step, old, _), by_rank = max(pieces.items())
    missing = [r for r in range(old) if r not in by_rank]
    if not missing:
        return f"the copies of step {step} disagree on a rank's layout"
    return (f"no survivor holds the step-{step} snapshot of rank(s) {', '.join(map(str, missing))} of world "
            f"size {old}, neither as its own nor as a buddy copy (a node and the node holding its buddy "
            "copy were both lost, or that copy was not complete)")


def _same_layout_step(offers: Sequence[Sequence[Offer]], world_size: int) -> int | None:
    """The newest step every rank wrote itself, at this world size."""
    per_rank = [{o.step for o in mine if (o.world_size, o.rank) == (world_size, r)}
                for r, mine in enumerate(offers)]
    common = set.intersection(*per_rank) if per_rank else set()
    return max(common) if common else None


def _replicated_step(offers: Sequence[Sequence[Offer]]) -> tuple[int, bytes, tuple[int, ...]] | str | None:
    """(step, digest, holders) of the newest replicated snapshot; a reason if that step is in
    doubt (offers of it disagree on the layout, or one of it is not replicated); None if none."""
    steps = [o.step for mine in offers for o in mine if o.replicated]
    if not steps:
        return None
    step = max(steps)
    at = [(r, o) for r, mine in enumerate(offers) for o in mine if o.step == step]
    if not all(o.replicated for _, o in at):
        return f"step {step} has replicated and sharded snapshots"
    digests = {o.digest for _, o in at}
    if len(digests) != 1:
        return f"the snapshots of step {step} disagree on the state's layout"
    holders = tuple(sorted({r for r, _ in at}))
    return step, digests.pop(), holders


def _by_coordinate(offers: Sequence[Sequence[Offer]], mesh: tuple[int, ...], coordinates: Sequence[int]
                   ) -> dict[tuple[int, int, int], dict[int, list[tuple[int, Offer]]]]:
    """A mesh's own snapshots written in this plane, by (step, old world size, generation):
    per coordinate, who holds one (holder, offer). Only a holder of its own coordinate's
    snapshot counts (``coordinates[holder]``: the plane stays within a node, so a node's
    local ranks keep their coordinates), so every sender reads its own slot."""
    n = math.prod(mesh)
    out: dict[tuple[int, int, int], dict[int, list[tuple[int, Offer]]]] = {}
    for holder, mine in enumerate(offers):
        for o in mine:
            if (o.buddy or o.replicated or not o.generation or o.mesh != tuple(mesh) or o.world_size % n
                    or not 0 <= o.rank < o.world_size or coordinates[holder] != o.coordinate):
                continue
            out.setdefault((o.step, o.world_size, o.generation), {}).setdefault(o.coordinate, []).append((holder, o))
    return out


def _coordinates(offers: Sequence[Sequence[Offer]], world_size: int, mesh: tuple[int, ...],
                 coordinates: Sequence[int]) -> Plan | None:
    """MEMORY or PEER for a mesh: the newest (step, old world size, generation) whose snapshots
    cover every coordinate with one layout digest each; each new rank restores its coordinate's
    from its own slot if it holds it, else from a holder of it (the receivers of a coordinate
    spread over its holders in rank order). None if no step is covered."""
    n = math.prod(mesh)
    if n < 1 or world_size % n or len(coordinates) != world_size:
        return None
    for (step, old, gen), by_coord in sorted(_by_coordinate(offers, mesh, coordinates).items(), reverse=True):
        if len(by_coord) != n or any(len({o.digest for _, o in held}) != 1 for held in by_coord.values()):
            continue  # a coordinate nobody holds, or copies of one that disagree: not this step
        holders = {c: sorted({h for h, _ in held}) for c, held in by_coord.items()}
        feeds, spread = [], dict.fromkeys(range(n), 0)
        for r in range(world_size):
            c = coordinates[r]
            if r in holders[c]:
                feeds.append(r)
            else:
                feeds.append(holders[c][spread[c] % len(holders[c])])
                spread[c] += 1
        readers = tuple(r for r in range(world_size) if feeds[r] == r)
        return Plan(MEMORY if len(readers) == world_size else PEER, step, readers, saved_world_size=old,
                    generation=gen, digests=tuple(by_coord[c][0][1].digest for c in range(n)),
                    mesh=tuple(mesh), coordinates=tuple(coordinates), feeds=tuple(feeds))
    return None


def _coordinates_missing(offers: Sequence[Sequence[Offer]], mesh: tuple[int, ...], coordinates: Sequence[int]) -> str:
    """Why no mesh step is covered (storage's reason)."""
    n = math.prod(mesh)
    by = _by_coordinate(offers, mesh, coordinates) if len(coordinates) == len(offers) else {}
    if not any(offers):
        return "no rank holds a snapshot"
    if not by:
        return (f"no snapshot was written at this mesh's plane degrees {tuple(mesh)} "
                "(a layout change: DCP reshards)")
    (step, old, _), by_coord = max(by.items())
    missing = [c for c in range(n) if c not in by_coord]
    if missing:
        return (f"no survivor holds the step-{step} snapshot of mesh coordinate(s) "
                f"{', '.join(map(str, missing))} (plane {' x '.join(map(str, mesh))}, world size {old}): "
                "every replica of it was lost")
    return f"the snapshots of step {step} disagree on a coordinate's layout"
