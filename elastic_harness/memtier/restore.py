"""The restore of one generation from memory: plan, read, move pieces, exchange, load.

``MemoryTier.restore`` builds one ``GenerationRestore`` over the tier's slots for the
generation that starts, and calls ``run`` once, on every rank in the same order (it is
collective, over ``wire``: the checkpoint group). What it does, in order:

1. **plan**: every rank's offers (the published snapshots in its own slots and buddy
   copies) are gathered once, and every rank computes the same ``choose`` plan from them;
   a buddy or mesh plan older than the newest complete checkpoint gives way to storage.
2. **read**, then **exchange** (``MEMORY``, ``PEER``): a holder reads the plan's snapshot
   from its own slot; under a replicated state (DDP) or a mesh's replicas, the ranks without
   it receive it from a holder (its tensor bytes straight into a slot of theirs, its
   skeleton as JSON: nothing received is unpickled), once every receiver's state was found
   to take it.
3. **move pieces** (``BUDDY``): every old rank's snapshot of the plan's step, read where it
   is held (own slot or buddy copy) and sent, one piece at a time in an order every rank
   follows, to the ranks without it; each rank reshards them into its state.
4. **load**: every rank fills its live state, and the ranks agree it worked.

A plan for storage unpublishes every rank's slots (they belong to a lineage this generation
does not continue). A failure before anything was loaded sends every rank to storage; one
after loading began stops the generation (its state may be half-filled). Either way every
slot is unpublished first (``unpublished``), so the next restart restores from storage.
Nothing calls the live state's ``state_dict()`` before the ranks agreed on a step (for an
optimizer without state, that call runs a zero step that creates it, which must not happen
on some ranks only, nor before a fresh start). ``last`` is the slot holding this rank's
newest snapshot afterwards, which the tier writes around from then on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from elastic_harness.memtier import buddy, peer, reshard, snapshot
from elastic_harness.memtier.choose import BUDDY, MEMORY, PEER, STORAGE, Plan, choose, offers_of
from elastic_harness.memtier.region import Region, unpublish
from elastic_harness.memtier.slots import HEADER_SIZE, SLACK, Header, next_slot


@dataclass(frozen=True)
class Restored:
    step: int
    seconds: float
    source: str = MEMORY  # MEMORY (own slot on every rank), PEER (some ranks received it) or BUDDY
    senders: tuple[int, ...] = ()  # PEER/BUDDY: the ranks that sent a snapshot to another
    receivers: int = 0  # PEER: how many ranks received it; BUDDY: how many pieces moved between ranks
    saved_world_size: int | None = None  # of the generation that wrote it
    # Where this rank's seconds went, in order (``GenerationRestore``): offers (read the slots, gather,
    # choose), layout (a receiver takes its state dicts; the ranks agree on the layout),
    # transfer (send or receive, agreed), load (into the live state, agreed), keep (publish).
    phases: tuple[tuple[str, float], ...] = ()


def restored_message(r: Restored, saved_world_size: int | None, world_size: int) -> str:
    """Pure: the ``resume`` event's line for a restore from memory."""
    sizes = (f"world size {world_size}" if saved_world_size in (None, world_size)
             else f"saved at world size {saved_world_size}, now {world_size}")
    via = (f", {r.receivers} rank(s) received it from rank(s) {', '.join(map(str, r.senders))}"
           if r.source == PEER else "")
    if r.source == BUDDY:
        via = (f", resharded in memory from every old rank's snapshot, own or a buddy copy; {r.receivers} "
               "moved between ranks")
    return f"restored from {r.source} at step {r.step} ({sizes}{via}), took {r.seconds:.3f} s"


class GenerationRestore:
    """One rank's part in restoring one generation from memory (the module docstring)."""

    def __init__(self, regions: list[Region], buddy_regions: list[Region], *, rank: int, world_size: int,
                 wire: peer.Wire, warn: Callable[[str], None], rules: peer.Rules, last: int | None) -> None:
        self.regions, self.buddy_regions = regions, buddy_regions  # own slots, buddy copies' slots
        self.rank, self.world_size, self.wire, self.warn = rank, world_size, wire, warn
        self.rules = rules  # what the job's layout allows (``peer.restore_rules``)
        self.last = last  # the slot holding this rank's newest snapshot
        self.plan: Plan | None = None
        self.unpublished = False  # every slot was unpublished: the tier forgets what they held

    def run(self, state: dict[str, Any], durable: Callable[[], int | None], t0: float) -> Restored | None:
        """Collective: fill ``state`` from memory as every rank's offers allow, or None
        (then every slot is unpublished: storage restores)."""
        plan, everyone, headers, copies = self._plan(durable)
        if plan.source == BUDDY:
            return self._restore_buddy(plan, state, everyone, headers, copies, t0)
        if plan.source == STORAGE:
            if self.rank == 0 and any(everyone):
                self.warn(f"the in-memory tier cannot restore this generation ({plan.reason}); "
                           "restoring from storage")
            self._unpublish()
            return None
        return self._restore_held(plan, state, headers, t0)

    def _plan(self, durable: Callable[[], int | None]) -> tuple[Plan, list, list, list]:
        """Collective: the plan every rank computes from every rank's offers, gathered once
        (a buddy or mesh plan older than the newest complete checkpoint gives way to storage),
        with the offers and this rank's own and buddy slots' headers."""
        headers = self._headers()
        copies = self._headers(self.buddy_regions)
        mine = offers_of(headers) + offers_of(copies, buddy=True)
        everyone = [peer.decode_offers(v) for v in self.wire.gather(peer.encode_offers(mine))]
        rules = self.rules
        if not rules.sharded:  # copies only ever restore sharded state
            everyone = [[o for o in offers if not o.buddy] for offers in everyone]
        plan = choose(everyone, world_size=self.world_size, replicated=rules.replicated,
                      sharded=rules.sharded, mesh=rules.mesh, coordinates=rules.coordinates)
        if plan.source == BUDDY or plan.mesh:
            older = buddy.older_than_storage(plan.step, durable(), "buddy copies" if plan.source == BUDDY
                                             else "mesh replicas' snapshots")
            if older is not None:
                plan = Plan(STORAGE, reason=older)
        self.plan = plan
        return plan, everyone, headers, copies

    def _restore_held(self, plan: Plan, state: dict[str, Any], headers: list, t0: float) -> Restored | None:
        """MEMORY or PEER: each rank reads the plan's snapshot from its own slot, or receives
        it from a holder, once the layouts are agreed; then every rank loads it."""
        laps = _Laps(t0)
        laps("offers")
        slot = self._slot_for(plan, headers)
        senders = plan.senders(self.world_size)
        trees, expect = self._expected(plan, state) if self.rank in senders else (None, None)
        if senders and not self._layouts_agree(plan, expect):  # before a byte moves
            return None
        laps("layout")
        got, problem, trees = self._exchange(plan, slot, senders, expect, state, trees)
        failed = peer.failing(self.wire, problem is not None)
        laps("transfer")
        if failed:  # nothing was loaded yet: every rank falls back to storage
            if problem:
                self.warn(f"rank {self.rank}: receiving step {plan.step} from a peer failed ({problem})")
            self._unpublish()
            return None
        self._agree_loaded(_load(state, *got, trees=trees), plan.step, "memory")
        laps("load")
        self.last = self._keep(plan, slot, got)
        laps("keep")
        return Restored(plan.step, time.perf_counter() - t0, plan.source, tuple(sorted(set(senders.values()))),
                        len(senders), plan.saved_world_size or None, phases=laps.done())

    def _layouts_agree(self, plan: Plan, expect: int | str | None) -> bool:
        """Collective: does every receiver's state take the snapshot (``_expected``)? If not,
        every rank falls back to storage."""
        mismatch = peer.failing(self.wire, isinstance(expect, str))
        if not mismatch:
            return True
        self.warn(f"rank {self.rank}: not receiving step {plan.step} from a peer: rank(s) {mismatch} "
                   f"have another layout{f' ({expect})' if isinstance(expect, str) else ''}; "
                   "restoring from storage")
        self._unpublish()
        return False

    def _agree_loaded(self, error: str | None, step: int, source: str) -> None:
        """Collective, once loading began: if it failed on any rank, every rank stops (its
        state may be half-filled), every slot unpublished first so the next restart restores
        from storage."""
        failed = peer.failing(self.wire, error is not None)
        if failed:
            self._unpublish()
            raise RuntimeError(f"restoring step {step} from {source} failed on rank(s) {failed} "
                               f"({f'rank {self.rank}: {error}' if error else 'see their warnings'}); "
                               "the next restart restores from storage")

    def _restore_buddy(self, plan: Plan, state: dict[str, Any], everyone: list, headers: list,
                       copies: list, t0: float) -> Restored | None:
        """Every old rank's snapshot of the plan's step: read here, or sent by its provider to
        the ranks without it (one piece at a time, in an order every rank follows); then each
        rank reshards them into its state (``reshard``)."""
        moves = buddy.moves(plan, everyone, self.world_size)
        pieces, problem = self._read_pieces(plan, headers, copies)
        moved = self._move_pieces(moves, pieces)  # every rank takes part, whatever it read
        problem = problem or moved
        failed = peer.failing(self.wire, problem is not None)
        if failed:  # nothing was loaded yet: every rank falls back to storage
            self.warn(f"rank {self.rank}: restoring step {plan.step} from buddy copies failed on rank(s) "
                       f"{failed}{f' ({problem})' if problem else ''}; restoring from storage")
            self._unpublish()
            return None
        error = None
        try:
            reshard.restore(state, [pieces[r][:3] for r in range(plan.saved_world_size)], rank=self.rank,
                            world_size=self.world_size)
        except Exception as e:  # noqa: BLE001 - reported to every rank, which then all stop
            error = f"{e!r:.300}"
        self._agree_loaded(error, plan.step, "buddy copies")
        self.last = None  # the own slots hold the old layout's snapshots: written over from now on
        return Restored(plan.step, time.perf_counter() - t0, BUDDY, tuple(sorted({s for _, s, _ in moves})),
                        len(moves), plan.saved_world_size)

    def _read_pieces(self, plan: Plan, headers: list, copies: list) -> tuple[dict[int, tuple], str | None]:
        """The old ranks' snapshots this rank holds (own or buddy copies), by old rank, and the
        first problem reading them."""
        pieces: dict[int, tuple] = {}
        problem = None
        for r in range(plan.saved_world_size):
            local = self._piece_here(plan, r, headers, copies)
            if local is not None:
                try:
                    pieces[r] = local()
                except Exception as e:  # noqa: BLE001 - agreed on by every rank
                    problem = problem or f"reading old rank {r}'s snapshot: {e!r:.200}"
        return pieces, problem

    def _move_pieces(self, moves: list[tuple[int, int, int]], pieces: dict[int, tuple]) -> str | None:
        """Send and receive the pieces ``moves`` name, in their order (every rank follows it);
        received ones go into ``pieces``. The first problem receiving, or None."""
        problem = None
        for r, sender, receiver in moves:
            if self.rank == sender:
                unsent = peer.send_piece(self.wire, receiver, pieces.get(r))
                if unsent:
                    self.warn(f"rank {self.rank}: cannot send a snapshot to rank {receiver} ({unsent})")
            elif self.rank == receiver:
                got, why = peer.receive_piece(self.wire, sender, r)
                if got is None:
                    problem = problem or why
                else:
                    pieces[r] = got
        return problem

    def _piece_here(self, plan: Plan, r: int, headers: list, copies: list) -> Callable[[], tuple] | None:
        """How to read old rank ``r``'s snapshot of the plan from this rank's slots: (skeleton,
        bytes, base, JSON skeleton or None); None if this rank holds none."""
        def match(h: Header | None) -> bool:
            return (h is not None and h.published and h.step == plan.step and h.generation == plan.generation
                    and (h.world_size, h.rank) == (plan.saved_world_size, r) and h.digest == plan.digests[r])

        for slot, h in enumerate(headers):
            if match(h):
                return lambda slot=slot: read_own(self.regions[slot])
        for slot, h in enumerate(copies):
            if match(h):
                return lambda slot=slot, h=h: read_copy(self.buddy_regions[slot], h)
        return None

    def _slot_for(self, plan: Plan, headers: list[Header | None]) -> int | None:
        """This rank's slot holding the plan's snapshot; None for a receiver."""
        if self.rank not in plan.holders:
            return None
        for slot, h in enumerate(headers):
            if h is None or not h.published or h.step != plan.step:
                continue
            if plan.mesh and _of_coordinate(h, plan, plan.coordinate(self.rank)):
                return slot
            if (plan.same_layout and (h.world_size, h.rank) == (self.world_size, self.rank)
                    or not plan.same_layout and not plan.mesh and h.replicated and h.digest == plan.digest):
                return slot
        raise AssertionError("a holder without its snapshot")  # the plan came from these headers

    def _expected(self, plan: Plan, state: dict[str, Any]) -> tuple[Any, int | str]:
        """A receiver: the state dicts to load into (``snapshot.targets``) and the tensor
        bytes its live state takes, if its layout digest is the plan's; else why not. (Every
        rank loads once the plan is agreed, so taking the live state dicts here creates an
        empty optimizer's state only where it is restored.)"""
        try:
            trees = snapshot.targets(state)
            mine = snapshot.capture_trees(trees)
        except Exception as e:  # noqa: BLE001 - agreed on by every rank
            return None, f"{e!r:.200}"
        want = plan.digests[plan.coordinate(self.rank)] if plan.mesh else plan.digest
        return trees, mine.data_len if mine.digest == want else "its state's layout digest differs"

    def _exchange(self, plan: Plan, slot: int | None, senders: dict[int, int], expect: int | str | None,
                  state: dict[str, Any], trees: Any) -> tuple[tuple, str | None, Any]:
        """Send the snapshot to this rank's receivers, or receive it from its sender: the
        snapshot to load, as (data, base, skeleton, data_len, local skeleton bytes), the
        problem that stops this rank from restoring it (then nothing was loaded anywhere),
        and the state dicts to load into if taken here (a sender takes its own while gloo
        moves the bytes, instead of after)."""
        if slot is None:
            return (*self._receive(plan, senders[self.rank], expect), trees)
        try:
            data, skeleton, header = read_slot(self.regions[slot])
        except Exception as e:  # noqa: BLE001 - agreed on by every rank
            data, skeleton, header, problem = None, None, None, f"{e!r:.300}"
        else:
            problem = None
        receivers = [r for r, s in senders.items() if s == self.rank]
        if receivers:
            works = self._send(receivers, data, skeleton, header)
            if works:
                try:
                    trees = snapshot.targets(state)
                except Exception as e:  # noqa: BLE001 - agreed on by every rank (nothing loaded yet)
                    problem = problem or f"{e!r:.300}"
            peer.wait_all(works)
        return (data, HEADER_SIZE, skeleton, 0, b""), problem, trees

    def _send(self, receivers: list[int], data: Any, skeleton: Any, header: Header | None) -> list[Any]:
        """The snapshot to each receiver: an announcement, the skeleton's JSON (encoded once),
        then the tensor bytes straight from this rank's slot (``peer.post_chunked``): the
        sends still in flight, to wait for (none where the wire only has blocking sends)."""
        try:
            raw = peer.encode_skeleton(skeleton) if header is not None else b""
        except snapshot.Unsupported as e:
            self.warn(f"rank {self.rank}: cannot send its snapshot to peers ({e})")
            raw = b""
        ok = bool(raw) and len(raw) <= peer.MAX_SKELETON
        body = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if ok else None
        for r in receivers:
            meta = torch.tensor([int(ok), header.data_len if ok else 0, len(raw) if ok else 0], dtype=torch.int64)
            self.wire.send(meta, r)
            if ok:
                self.wire.send(body, r)
        if not (ok and header.data_len):
            return []
        return peer.post_chunked(self.wire, data[HEADER_SIZE:HEADER_SIZE + header.data_len], receivers)

    def _receive(self, plan: Plan, src: int, expect: Any) -> tuple[tuple, str | None]:
        meta = torch.zeros(3, dtype=torch.int64)
        self.wire.recv(meta, src)
        ok, data_len, json_len = (int(v) for v in meta)
        if not ok:
            return (), f"rank {src} could not send step {plan.step}"
        if not (0 < json_len <= peer.MAX_SKELETON and data_len == expect):  # not a sender of this job's
            raise RuntimeError(f"rank {src} announced a snapshot of {data_len}+{json_len} bytes, "
                               f"this rank's state takes {expect}")
        raw = torch.empty(json_len, dtype=torch.uint8)
        self.wire.recv(raw, src)
        problem = None
        try:
            skeleton = peer.decode_skeleton(raw.numpy().tobytes())
            local = snapshot.pack_skeleton(skeleton)  # our own bytes, for our slot
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            skeleton, local, problem = None, b"", f"its skeleton is malformed ({e!r:.200})"
        data, base = self._room(data_len + len(local))
        if data_len:  # straight into this rank's slot
            peer.recv_chunked(self.wire, data[base:base + data_len], src)
        return (data, base, skeleton, data_len, local), problem

    def _room(self, size: int) -> tuple[torch.Tensor, int]:
        """Where a received snapshot goes: a slot of this rank's (it holds it from then on),
        else a buffer."""
        if self.regions:
            try:
                return self.regions[next_slot(self.last, len(self.regions))].begin(HEADER_SIZE + size + SLACK), HEADER_SIZE
            except OSError:
                pass
        return torch.empty(size, dtype=torch.uint8), 0

    def _keep(self, plan: Plan, slot: int | None, got: tuple) -> int | None:
        """After a restore: the slot now holding this rank's newest snapshot (a receiver's
        is published, so a later restart finds it in its own memory)."""
        if slot is not None or not self.regions:
            return slot
        data, base, _, data_len, local = got
        target = next_slot(self.last, len(self.regions))
        if base != HEADER_SIZE:
            return None  # it went into a buffer
        data[base + data_len:base + data_len + len(local)].copy_(torch.frombuffer(bytearray(local), dtype=torch.uint8))
        if plan.mesh:  # its coordinate's snapshot, as if old rank ``c`` wrote it (replicas are interchangeable)
            c = plan.coordinate(self.rank)
            header = Header(True, plan.step, plan.saved_world_size, c, data_len, len(local), plan.digests[c],
                            generation=plan.generation, mesh=plan.mesh, coordinate=c)
        else:
            header = Header(True, plan.step, self.world_size, self.rank, data_len, len(local), plan.digest,
                            replicated=True)
        self.regions[target].publish(header)
        return target

    def _headers(self, regions: list[Region] | None = None) -> list[Header | None]:
        try:
            return [r.header() for r in (self.regions if regions is None else regions)]
        except OSError as e:
            self.warn(f"rank {self.rank}: cannot read its in-memory checkpoint slots ({e!r:.200})")
            return []

    def _unpublish(self) -> None:
        """Every slot unpublished: the next restart restores from storage."""
        unpublish(self.regions + self.buddy_regions)
        self.last, self.unpublished = None, True


def read_slot(region: Region) -> tuple[torch.Tensor, Any, Header]:
    """A slot's bytes, skeleton (our own node's memory, written by our job) and header."""
    header = region.header()
    data = region.data()
    return data, snapshot.read_skeleton(data, HEADER_SIZE, header.data_len, header.skeleton_len), header


def read_own(region: Region) -> tuple:
    """An own slot's snapshot as a piece: (skeleton, bytes, base, None)."""
    data, skeleton, _ = read_slot(region)
    return skeleton, data, HEADER_SIZE, None


def read_copy(region: Region, h: Header) -> tuple:
    """A buddy copy as a piece: (skeleton, bytes, base, its JSON skeleton)."""
    data = region.data()
    raw = data[HEADER_SIZE + h.data_len:HEADER_SIZE + h.data_len + h.skeleton_len].numpy().tobytes()
    return peer.decode_skeleton(raw), data, HEADER_SIZE, raw  # JSON its sender wrote: never unpickled


def _load(state: dict[str, Any], data: Any, base: int, skeleton: Any, *_: Any, trees: Any = None) -> str | None:
    """Fill ``state`` from a snapshot's bytes and skeleton (``trees``: its state dicts, if
    already taken); why it failed, or None."""
    try:
        trees = snapshot.targets(state) if trees is None else trees
        misfit = snapshot.misfit(skeleton, trees)
        if misfit:
            return f"the snapshot does not fit this state's layout ({misfit})"
        snapshot.restore_into(state, trees, skeleton, data, base)
    except Exception as e:  # noqa: BLE001 - reported to every rank, which then all stop
        return f"{e!r:.300}"
    return None



def _of_coordinate(h: Header, plan: Plan, c: int) -> bool:
    """Is ``h`` a snapshot of coordinate ``c`` that a mesh plan restores?"""
    return (h.step == plan.step and h.generation == plan.generation and h.world_size == plan.saved_world_size
            and h.mesh == tuple(plan.mesh) and h.coordinate == c and h.digest == plan.digests[c]
            and not h.replicated)


class _Laps:
    """Seconds between successive named moments, from ``t0``."""

    def __init__(self, t0: float) -> None:
        self._last, self._laps = t0, []

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self._laps.append((name, round(now - self._last, 4)))
        self._last = now

    def done(self) -> tuple[tuple[str, float], ...]:
        return tuple(self._laps)
