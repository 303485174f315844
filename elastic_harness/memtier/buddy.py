"""Pure: who keeps a copy of whose snapshot (the buddy ring), and what a copy may be.

Under sharded state (FSDP) a rank's snapshot is the only copy of its shard, so a lost node
takes its shards with it. Each rank therefore also keeps, in its agent's memory, a copy of
one rank of the next node: the rank ``local_size`` above it, around the ring (node ``i``'s
local rank ``l`` holds node ``i + 1``'s local rank ``l``; the last node holds node 0's). Any
single node lost leaves every rank's snapshot in a survivor's memory, as its own snapshot
or as a copy; a node lost with the node that held its copies (its ring predecessor) does
not, and that restore falls back to storage (``choose``).

Copies are sent from the sender's own published slot over the pair's stream
(``conduit``), after the snapshots the ranks agree to send (``due``), and received into one
of the holder's two buddy slots (the one not holding its newest copy), published only once
every byte arrived (``exchange``). Memory: two copies of the buddy's snapshot per rank (``bound``).

A copy is only useful with the other ranks' own snapshots of its step, so each rank keeps
its own snapshot of the newest step whose copies every rank finished (``settled``: no rank
reported copies moving in a later step's all-reduce) and of the step being copied, and
writes new snapshots into a slot holding neither (``writable``). Before that rule a
snapshot not sent (copies still moving, or held back by the budget) went into the slot of
the last copied step, and the survivors of a node loss then held copies of a step whose
own snapshots were gone: they fell back to an older step, or to storage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# A received copy larger than this many times the holder's own snapshot (plus ``SPARE``) is
# refused: under FSDP the shards of one job differ by at most a row per tensor.
GROWTH = 2
SPARE = 1 << 20
# An announcement, ahead of a copy's bytes on its stream: MAGIC, step, generation, world size,
# rank, tensor bytes, JSON bytes, digest (4).
META_FIELDS = 11
MAGIC = 0x45484255_44445931  # first: the stream is where a copy begins (``exchange``)


def active(world_size: int, local_size: int, sharded: bool) -> bool:
    """Copies are kept when the state is sharded and the job spans more than one node."""
    return sharded and local_size > 0 and world_size > local_size and world_size % local_size == 0


def holder_of(rank: int, world_size: int, local_size: int) -> int:
    """The rank that keeps ``rank``'s copy: the same local rank of the previous node."""
    return (rank - local_size) % world_size


def source_of(rank: int, world_size: int, local_size: int) -> int:
    """The rank whose copy ``rank`` keeps: the same local rank of the next node."""
    return (rank + local_size) % world_size


def due(anyone_busy: bool, snapshot_taken: bool) -> bool:
    """Send copies after this snapshot? Only when no rank still moves the previous ones
    (``anyone_busy``: agreed through the step's all-reduce, so every pair starts the same
    exchanges and none waits on a send; a busy ring skips a snapshot, it does not queue)."""
    return snapshot_taken and not anyone_busy


def writable(last: int | None, slots: int, kept: set[int]) -> int | None:
    """The own slot the next snapshot goes into: the one after the newest (``last``, as
    ``slots.next_slot``) unless it is ``kept`` (holding the step of the newest settled copy,
    or of the copy in flight), else the next one that is not; None when every slot is kept
    (that snapshot is skipped). Writing into the newest snapshot's slot leaves the kept one
    as this rank's newest while it is written (a crash then restores that older step)."""
    for i in range(slots):
        slot = (0 if last is None else last + 1 + i) % slots
        if slot not in kept:
            return slot
    return None


def acceptable(meta: list[int], *, world_size: int, source: int, limit: int) -> str | None:
    """Why the copy a sender announced (``META_FIELDS`` int64) is refused, or None: another
    world size or rank than this holder's source, a generation of 0, or more bytes than
    ``limit`` (a bogus announcement)."""
    if len(meta) != META_FIELDS or meta[0] != MAGIC:
        return "a malformed announcement"
    step, generation, world, rank, data_len, json_len = meta[1:7]
    if (world, rank) != (world_size, source):
        return f"a copy of rank {rank} at world size {world}, this rank keeps rank {source}'s at {world_size}"
    if step < 0 or not generation:
        return "a copy without a step or generation"
    if data_len < 0 or not 0 < json_len <= limit or data_len + json_len > limit:
        return f"a copy of {data_len}+{json_len} bytes, more than the {limit} allowed"
    return None


def bound(own_bytes: int) -> int:
    """The largest copy a holder accepts, from its own snapshot's size."""
    return GROWTH * own_bytes + SPARE


STUCK_SNAPSHOTS = 100  # snapshots in a row that found a copy still moving somewhere: given up


def stuck(waiting: int) -> bool:
    """Give copies up for this generation? ``waiting`` snapshots in a row found some rank's
    receive still in flight: one that will not land (its sender's link broke before it sent),
    which would keep both own slots held (``writable``) and stop the own snapshots too. Every
    rank counts the same all-reduced flags, so all give up at the same snapshot."""
    return waiting > STUCK_SNAPSHOTS


def holds(offers: Sequence[Any], plan: Any, old_rank: int) -> bool:
    """Does a rank with these offers hold old rank ``old_rank``'s snapshot of the plan?"""
    return any(o.step == plan.step and o.generation == plan.generation
               and (o.world_size, o.rank) == (plan.saved_world_size, old_rank)
               and o.digest == plan.digests[old_rank] for o in offers)


def moves(plan: Any, offers: Sequence[Sequence[Any]], world_size: int) -> list[tuple[int, int, int]]:
    """(old rank, sender, receiver) for every piece a rank lacks, in the order every rank
    follows: each rank of the new world size takes every old rank's snapshot (rank 0's for
    what is not sharded, the others' for the rows they overlap; a finer choice is left for
    later), from the plan's provider of it."""
    return [(r, plan.providers[r], j) for r in range(plan.saved_world_size) for j in range(world_size)
            if not holds(offers[j], plan, r)]


def older_than_storage(step: int, durable: int | None, what: str = "buddy copies") -> str | None:
    """Why a buddy (or mesh coordinate, ``what``) restore of ``step`` is not used, or None:
    storage holds a newer complete checkpoint (the copies of the step a durable save forced
    did not all arrive), which redoes fewer steps."""
    if durable is not None and durable > step:
        return (f"the newest step the {what} cover, {step}, is older than the checkpoint of step "
                f"{durable} on storage")
    return None


def every(copy_s: float, step_s: float, budget: float) -> int:
    """Steps between copies so that they cost at most ``budget`` of step time
    (``cadence.interval`` over the seconds a copy measured holding the training thread,
    ``exchange.BuddyLink.copy_cost_s``, a budget apart from the own snapshots'; 1 with no
    measurement yet or a budget of 0)."""
    from elastic_harness.memtier.cadence import interval

    return interval(copy_s, step_s, budget, 1)


def hold(step: int, last_copy: int, copy_s: float, step_s: float, budget: float) -> bool:
    """Rank 0's say, added to the step's "copies busy" value: wait before the next copy
    until ``every`` steps passed since the last one."""
    return step - last_copy < every(copy_s, step_s, budget)
