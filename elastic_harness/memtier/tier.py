"""The worker's side of the in-memory tier: save a snapshot, restore the newest usable one.

Call order (every rank of a generation, same order): ``restore(state, layout)`` once,
before training and before any storage restore (it is collective, over ``wire``: the
checkpoint group); then ``save(step, state)`` after the steps ``cadence`` names (no
collective; each rank writes its own slot). Where a failing rank keeps its last step
(``memory_on_failure``): ``arm(step, state)`` after every step, ``disarm()`` when the state
starts to change (the optimizer's step), ``keep_armed()`` on the way down after a failure.
``close()`` at the end.

``restore`` gathers every rank's offers (the published snapshots in its slots) once and
follows ``choose``: every rank reads the snapshot it wrote itself at this world size (a
worker crash); or, when the state is replicated (DDP), the newest step any rank holds, at
any world size: its holders read their own slot, the other ranks receive it from a holder
(``peer``: its tensor bytes into their own slot, its skeleton as JSON; nothing received is
unpickled); or, under a mesh whose replicas grew or shrank, the same per coordinate of its
plane (a rank receives its coordinate's snapshot from a replica holding it; a storage
checkpoint newer than that step wins); or storage, and then every rank's slots are unpublished (they belong to a
lineage this generation does not continue). A rank that cannot open its slots takes part
with none, so the ranks always agree. Nothing calls the live state's ``state_dict()``
before the ranks agreed on a step (for an optimizer without state, that call runs a zero
step that creates it, which must not happen on some ranks only, nor before a fresh start).
A transfer that fails before any state was touched falls back to storage on every rank;
once they agreed and loading began, a snapshot that does not fit the state's layout, or
fails to load, stops the generation (its state may be half-filled): every slot is
unpublished first, so the next restart restores from storage.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from elastic_harness.errors import os_reason
from elastic_harness.memtier import buddy, peer, reshard, snapshot
from elastic_harness.memtier.choose import BUDDY, MEMORY, PEER, STORAGE, Plan, choose, offers_of
from elastic_harness.memtier.conduit import Conduit
from elastic_harness.memtier.exchange import BuddyLink
from elastic_harness.memtier.host import SLOTS_PER_RANK, slot_paths
from elastic_harness.memtier.region import Region
from elastic_harness.memtier.slots import HEADER_SIZE, Header, next_slot

SLACK = 4096
LINK_SETUP_S = 30.0  # the buddy copies' streams: connect and prove the key, every rank at once


@dataclass(frozen=True)
class Restored:
    step: int
    seconds: float
    source: str = MEMORY  # MEMORY (own slot on every rank), PEER (some ranks received it) or BUDDY
    senders: tuple[int, ...] = ()  # PEER/BUDDY: the ranks that sent a snapshot to another
    receivers: int = 0  # PEER: how many ranks received it; BUDDY: how many pieces moved between ranks
    saved_world_size: int | None = None  # of the generation that wrote it
    # Where this rank's seconds went, in order (``_restore``): offers (read the slots, gather,
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


class MemoryTier:
    def __init__(self, regions: list[Region], *, rank: int, world_size: int, wire: peer.Wire,
                 warn: Callable[[str], None], buddy_regions: list[Region] | None = None, local_size: int = 0,
                 generation: int = 0, link_key: bytes | None = None, link_host: str = "127.0.0.1") -> None:
        self.regions, self.rank, self.world_size, self.wire = regions, rank, world_size, wire
        # The buddy copies' link (``conduit``): the job's key its ends prove, the address this
        # rank listens on. No key: no copies (the same on every rank: it comes from the job).
        self.link_key, self.link_host = link_key, link_host
        # Copies of another node's rank's snapshot (``buddy``); used under sharded state only.
        self.buddy_regions = buddy_regions or []
        self.local_size, self.generation = local_size, generation
        self.link: BuddyLink | None = None  # set by ``restore`` when copies are kept
        self.copy_s = 0.0  # seconds the last ``save`` spent starting a buddy copy (0: none)
        self._warn = warn  # every rank may report its own trouble
        self._last: int | None = None  # the slot holding this rank's newest snapshot
        # Own slots kept for the buddy copies (``buddy.writable``): the newest step whose
        # copies every rank finished, and the step last sent until they have.
        self._copied: int | None = None
        self._unsettled: int | None = None
        self._waiting = 0  # snapshots in a row that found a copy moving somewhere (``buddy.stuck``)
        self._views = [snapshot.Views() for _ in regions]
        # What the job's layout allows (``restore`` learns it): snapshots saved from then on are
        # marked replicated, or carry their mesh plane and coordinate.
        self.rules = peer.Rules()
        self.plan: Plan | None = None  # the last restore's
        # ``arm``: (step, capture) a failing rank keeps on its way down (``keep_armed``);
        # ``_newest``: the step of the newest snapshot this rank published.
        self._armed: tuple[int, snapshot.Capture] | None = None
        self._newest: int | None = None

    @classmethod
    def open(cls, described: str, local_rank: int, *, rank: int, world_size: int, wire: peer.Wire,
             warn: Callable[[str], None], local_size: int = 0, generation: int = 0,
             link_key: bytes | None = None, link_host: str = "127.0.0.1") -> MemoryTier:
        """This rank's slots from the agent's description (``host.describe``): its own first
        (``SLOTS_PER_RANK``), then its buddy slots (with ``link_key``, the job's key: buddy
        copies are kept where the state is sharded, over a link on ``link_host``)."""
        regions: list[Region] = []
        try:
            for path in slot_paths(described, local_rank):
                regions.append(Region(path))
        except OSError as e:
            for region in regions:
                region.close()
            regions = []
            warn(f"rank {rank}: cannot open its in-memory checkpoint slots ({os_reason(e)}); "
                 "restarts restore from storage")
        own, spare = regions[:SLOTS_PER_RANK], regions[SLOTS_PER_RANK:]
        if link_key is None:
            for region in spare:
                region.close()
            spare = []
        return cls(own, rank=rank, world_size=world_size, wire=wire, warn=warn, buddy_regions=spare,
                   local_size=local_size, generation=generation, link_key=link_key, link_host=link_host)

    def restore(self, state: dict[str, Any], layout: peer.Layout | None = None, *, portable: bool = True,
                durable: Callable[[], int | None] = lambda: None) -> Restored | None:
        """Collective: fill ``state`` from memory (own, a peer's, or resharded from own
        snapshots and buddy copies, ``choose``), or None. ``layout``: the job's
        (``runtime.topology``), read by ``peer.restore_rules``: under ``ddp`` snapshots saved
        from now on are marked replicated; under ``fsdp`` buddy copies are kept from now on,
        when the job spans nodes; under a mesh snapshots carry its plane and coordinate, and
        replicas restore by coordinate. None, or a state not ``portable`` (``peer.portable``):
        each rank only restores its own snapshot at this world size. ``durable``: collective,
        the newest complete checkpoint's step (a buddy or mesh coordinate restore older than it
        is not used)."""
        t0 = time.perf_counter()
        self.rules = peer.restore_rules(layout, self.world_size, portable)
        restored = self._restore(state, durable, t0)
        if self.link_key is not None and buddy.active(self.world_size, self.local_size, self.rules.sharded):
            self.link = self._link()  # collective, as every input to the condition is the job's
        return restored

    def _link(self) -> BuddyLink | None:
        """Collective: the buddy copies' link, when every rank set its streams up (``conduit``)."""
        assert self.link_key is not None
        holder = buddy.holder_of(self.rank, self.world_size, self.local_size)
        source = buddy.source_of(self.rank, self.world_size, self.local_size)
        conduit = Conduit.connect(rank=self.rank, holder=holder, source=source, generation=self.generation,
                                  key=self.link_key, host=self.link_host, gather=self.wire.gather,
                                  timeout=LINK_SETUP_S, able=bool(self.buddy_regions), warn=self._warn)
        if conduit is None:
            return None
        return BuddyLink(self.buddy_regions, rank=self.rank, world_size=self.world_size, local_size=self.local_size,
                         generation=self.generation, conduit=conduit, warn=self._warn)

    def _restore(self, state: dict[str, Any], durable: Callable[[], int | None], t0: float) -> Restored | None:
        plan, everyone, headers, copies = self._plan(durable)
        if plan.source == BUDDY:
            return self._restore_buddy(plan, state, everyone, headers, copies, t0)
        if plan.source == STORAGE:
            if self.rank == 0 and any(everyone):
                self._warn(f"the in-memory tier cannot restore this generation ({plan.reason}); "
                           "restoring from storage")
            self._unpublish_all()
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
        failed = self._failing(problem is not None)
        laps("transfer")
        if failed:  # nothing was loaded yet: every rank falls back to storage
            if problem:
                self._warn(f"rank {self.rank}: receiving step {plan.step} from a peer failed ({problem})")
            self._unpublish_all()
            return None
        self._agree_loaded(self._load(state, *got, trees=trees), plan.step, "memory")
        laps("load")
        self._last = self._keep(plan, slot, got)
        laps("keep")
        return Restored(plan.step, time.perf_counter() - t0, plan.source, tuple(sorted(set(senders.values()))),
                        len(senders), plan.saved_world_size or None, phases=laps.done())

    def _layouts_agree(self, plan: Plan, expect: int | str | None) -> bool:
        """Collective: does every receiver's state take the snapshot (``_expected``)? If not,
        every rank falls back to storage."""
        mismatch = self._failing(isinstance(expect, str))
        if not mismatch:
            return True
        self._warn(f"rank {self.rank}: not receiving step {plan.step} from a peer: rank(s) {mismatch} "
                   f"have another layout{f' ({expect})' if isinstance(expect, str) else ''}; "
                   "restoring from storage")
        self._unpublish_all()
        return False

    def _agree_loaded(self, error: str | None, step: int, source: str) -> None:
        """Collective, once loading began: if it failed on any rank, every rank stops (its
        state may be half-filled), every slot unpublished first so the next restart restores
        from storage."""
        failed = self._failing(error is not None)
        if failed:
            self._unpublish_all()
            raise RuntimeError(f"restoring step {step} from {source} failed on rank(s) {failed} "
                               f"({f'rank {self.rank}: {error}' if error else 'see their warnings'}); "
                               "the next restart restores from storage")

    def _failing(self, bad: bool) -> list[int]:
        """Collective: the ranks for which ``bad`` holds (every rank learns the same list)."""
        return [r for r, (b,) in enumerate(self.wire.gather([int(bad)])) if b]

    def _restore_buddy(self, plan: Plan, state: dict[str, Any], everyone: list, headers: list,
                       copies: list, t0: float) -> Restored | None:
        """Every old rank's snapshot of the plan's step: read here, or sent by its provider to
        the ranks without it (one piece at a time, in an order every rank follows); then each
        rank reshards them into its state (``reshard``)."""
        moves = buddy.moves(plan, everyone, self.world_size)
        pieces, problem = self._read_pieces(plan, headers, copies)
        moved = self._move_pieces(moves, pieces)  # every rank takes part, whatever it read
        problem = problem or moved
        failed = self._failing(problem is not None)
        if failed:  # nothing was loaded yet: every rank falls back to storage
            self._warn(f"rank {self.rank}: restoring step {plan.step} from buddy copies failed on rank(s) "
                       f"{failed}{f' ({problem})' if problem else ''}; restoring from storage")
            self._unpublish_all()
            return None
        error = None
        try:
            reshard.restore(state, [pieces[r][:3] for r in range(plan.saved_world_size)], rank=self.rank,
                            world_size=self.world_size)
        except Exception as e:  # noqa: BLE001 - reported to every rank, which then all stop
            error = f"{e!r:.300}"
        self._agree_loaded(error, plan.step, "buddy copies")
        self._last = None  # the own slots hold the old layout's snapshots: written over from now on
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
                self._send_piece(receiver, pieces.get(r))
            elif self.rank == receiver:
                got, why = self._receive_piece(sender, r)
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
                return lambda slot=slot: self._read_own(slot)
        for slot, h in enumerate(copies):
            if match(h):
                return lambda slot=slot, h=h: self._read_copy(slot, h)
        return None

    def _read_own(self, slot: int) -> tuple:
        data, skeleton, _ = self._read(slot)
        return skeleton, data, HEADER_SIZE, None

    def _read_copy(self, slot: int, h: Header) -> tuple:
        data = self.buddy_regions[slot].data()
        raw = data[HEADER_SIZE + h.data_len:HEADER_SIZE + h.data_len + h.skeleton_len].numpy().tobytes()
        return peer.decode_skeleton(raw), data, HEADER_SIZE, raw  # JSON its sender wrote: never unpickled

    def _send_piece(self, receiver: int, piece: tuple | None) -> None:
        raw = b""
        if piece is not None:
            try:
                raw = piece[3] if piece[3] is not None else peer.encode_skeleton(piece[0])
            except snapshot.Unsupported as e:
                self._warn(f"rank {self.rank}: cannot send a snapshot to rank {receiver} ({e})")
        data_len = _data_len(piece[0]) if raw else 0
        self.wire.send(torch.tensor([int(bool(raw)), data_len, len(raw)], dtype=torch.int64), receiver)
        if raw:
            self.wire.send(torch.frombuffer(bytearray(raw), dtype=torch.uint8), receiver)
            if data_len:
                self.wire.send(piece[1][piece[2]:piece[2] + data_len], receiver)

    def _receive_piece(self, sender: int, r: int) -> tuple[tuple | None, str]:
        meta = torch.zeros(3, dtype=torch.int64)
        self.wire.recv(meta, sender)
        ok, data_len, json_len = (int(v) for v in meta)
        if not ok:
            return None, f"rank {sender} could not send old rank {r}'s snapshot"
        if not 0 < json_len <= peer.MAX_SKELETON or data_len < 0:
            raise RuntimeError(f"rank {sender} announced a snapshot of {data_len}+{json_len} bytes")
        raw = torch.empty(json_len, dtype=torch.uint8)
        self.wire.recv(raw, sender)
        data = torch.empty(data_len, dtype=torch.uint8)
        if data_len:
            self.wire.recv(data, sender)
        try:
            skeleton = peer.decode_skeleton(raw.numpy().tobytes())
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            return None, f"old rank {r}'s skeleton from rank {sender} is malformed ({e!r:.200})"
        if _data_len(skeleton) > data_len:
            return None, f"old rank {r}'s skeleton from rank {sender} names more bytes than it sent"
        return (skeleton, data, 0, None), ""

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
            data, skeleton, header = self._read(slot)
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
            self._warn(f"rank {self.rank}: cannot send its snapshot to peers ({e})")
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
                return self.regions[next_slot(self._last, len(self.regions))].begin(HEADER_SIZE + size + SLACK), HEADER_SIZE
            except OSError:
                pass
        return torch.empty(size, dtype=torch.uint8), 0

    def _keep(self, plan: Plan, slot: int | None, got: tuple) -> int | None:
        """After a restore: the slot now holding this rank's newest snapshot (a receiver's
        is published, so a later restart finds it in its own memory)."""
        if slot is not None or not self.regions:
            return slot
        data, base, _, data_len, local = got
        target = next_slot(self._last, len(self.regions))
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

    def moving(self) -> bool:
        """Is a buddy copy still moving, to or from this rank? (No rank's, agreed in a
        step's all-reduce: the last copy ended everywhere, ``save``'s ``settled``.)"""
        return self.link is not None and self.link.moving()

    def busy(self, step: int = 0, step_s: float = 0.0, budget: float = 0.0) -> bool:
        """Are buddy copies still moving, to or from this rank, or (rank 0, given the step,
        the step time and the budget) is the next copy not due yet (``buddy.hold``)? The
        step's all-reduce carries it, so every rank agrees whether the next snapshot sends
        (``buddy.due``)."""
        if self.link is None:
            return False
        if self.link.busy():
            return True
        return bool(budget) and buddy.hold(step, self.link.last_step, self.link.copy_cost_s(), step_s, budget)

    def copy_every(self, step_s: float, budget: float) -> tuple[int, float] | None:
        """(steps between buddy copies, seconds a copy holds the training thread) as ``busy``
        holds them to now; None without copies."""
        if self.link is None:
            return None
        cost = self.link.copy_cost_s()
        return buddy.every(cost, step_s, budget), cost

    def save(self, step: int, state: dict[str, Any], *, send: bool = False, settled: bool = False) -> bool:
        """Snapshot ``state`` as ``step`` into the slot not holding this rank's newest one,
        nor the snapshot the buddy copies need (``buddy.writable``); ``send``: then send it
        to this rank's buddy holder, in the background. ``settled``: no rank reported copies
        moving in this step's all-reduce (the last copy sent is complete everywhere). False
        if skipped (every slot is kept: the previous snapshots stay)."""
        self.copy_s = 0.0
        if not self.regions:
            return False
        slot = buddy.writable(self._last, len(self.regions), self._kept_for_copies(settled))
        if slot is None or (self.link is not None and self.link.sending(slot)):
            return False
        written = self._write(slot, step, state)
        if written is None:
            return False
        self._last, self._newest = slot, step
        if send and self.link is not None and not self.link.broken:
            self._unsettled = slot
            t0 = time.perf_counter()
            self._send_copy(slot, *written)
            self.copy_s = time.perf_counter() - t0
        return True

    def _kept_for_copies(self, settled: bool) -> set[int]:
        """The own slots the buddy copies still need (the newest settled copy's, the one in
        flight), once this step's all-reduce said whether copies moved (``settled``). Copies
        stuck for ``buddy.STUCK_SNAPSHOTS`` snapshots stop for the generation."""
        if self.link is not None:
            self._waiting = 0 if settled else self._waiting + 1
            if buddy.stuck(self._waiting):
                self._warn(f"rank {self.rank}: a buddy copy has been in flight for {self._waiting} snapshots; "
                           "copies stop for this generation, snapshots go on")
                self.link.stop()
                self.link, self._copied, self._unsettled = None, None, None
        if settled and self._unsettled is not None:
            self._copied, self._unsettled = self._unsettled, None
            if self.link is not None:
                self.link.settled()
        return {s for s in (self._copied, self._unsettled) if s is not None} if self.link is not None else set()

    def arm(self, step: int, state: dict[str, Any]) -> None:
        """Take ``step``'s capture (its tensors by reference, every plain value pickled now)
        for ``keep_armed``: the step hook arms after each step, once the step counter moved;
        the optimizer's next step disarms (``disarm``). A snapshot of the same step then
        writes this capture instead of taking another."""
        self._armed = None
        if self.regions:
            with contextlib.suppress(snapshot.Unsupported, RuntimeError):  # the next save says why
                self._armed = (step, snapshot.capture(state))

    def disarm(self) -> None:
        self._armed = None

    def keep_armed(self) -> int | None:
        """On a failing rank's way down: publish the armed step's snapshot, if every tensor
        still holds that step's bytes (``snapshot.intact``); that step (also when it was
        already published), or None. Never raises: the failure being reported must win."""
        armed, self._armed = self._armed, None
        if armed is None or not self.regions or not snapshot.intact(armed[1]):
            return None
        step, cap = armed
        if step == self._newest:
            return step
        slot = buddy.writable(self._last, len(self.regions), set())
        try:
            if slot is None:
                return None
            self._put(slot, step, cap)  # only the slot written is unpublished if this fails
        except Exception:  # noqa: BLE001 - on the way down after another failure
            return None
        self._last, self._newest = slot, step
        return step

    def _write(self, slot: int, step: int, state: dict[str, Any]
               ) -> tuple[torch.Tensor, Header, snapshot.Capture] | None:
        """Capture ``state`` (or take the armed capture of ``step``, its tensors untouched
        since) into own ``slot`` and publish it: its bytes, header and capture; None when that
        failed (then the tier is off for this worker)."""
        armed = self._armed
        try:
            if armed is not None and armed[0] == step and snapshot.intact(armed[1]):
                cap = armed[1]
            else:
                cap = snapshot.capture(state)
            data, header = self._put(slot, step, cap)
        except (OSError, snapshot.Unsupported, RuntimeError) as e:
            self._warn(f"rank {self.rank}: in-memory checkpoint at step {step} failed ({e!r:.200}); "
                       "the tier is off for this worker, restarts restore from storage")
            self._unpublish_all()
            self.close()
            return None
        return data, header, cap

    def _put(self, slot: int, step: int, cap: snapshot.Capture) -> tuple[torch.Tensor, Header]:
        """Write ``cap`` as ``step`` into own ``slot`` and publish it (its bytes and header)."""
        region, rules = self.regions[slot], self.rules
        # Room to spare: the skeleton (plain values such as a learning rate) may grow a little.
        data = region.begin(HEADER_SIZE + cap.data_len + len(cap.skeleton) + SLACK, pin=not cap.cpu)
        snapshot.write(cap, data, HEADER_SIZE, self._views[slot])
        header = Header(True, step, self.world_size, self.rank, cap.data_len, len(cap.skeleton),
                        cap.digest, replicated=rules.replicated and not cap.sharded,
                        generation=self.generation, mesh=rules.mesh or (),
                        coordinate=rules.coordinates[self.rank] if rules.mesh else 0)
        region.publish(header)
        return data, header

    def _send_copy(self, slot: int, data: torch.Tensor, header: Header, cap: snapshot.Capture) -> None:
        # our own pickled skeleton, just written: sent as JSON, for a holder that never unpickles
        self.link.start(slot, data, header, cap.parts, buddy.bound(cap.data_len + 4 * len(cap.skeleton)))

    def settle(self, timeout: float) -> None:
        """At a normal end (the last step, a drain: every rank is there): let the buddy
        copies in flight finish, up to ``timeout``. Never after a failure: a peer that died
        would hold every rank here until the group's timeout."""
        if self.link is not None:
            self.link.close(timeout)

    def close(self) -> None:
        """Unmap every slot; copies still in flight are abandoned (their streams closed; a
        copy not fully received stays unpublished)."""
        if self.link is not None:
            self.link.stop()
        self.link, self._armed = None, None
        for region in self.regions + self.buddy_regions:
            region.close()
        self.regions, self.buddy_regions = [], []

    def _headers(self, regions: list[Region] | None = None) -> list[Header | None]:
        try:
            return [r.header() for r in (self.regions if regions is None else regions)]
        except OSError as e:
            self._warn(f"rank {self.rank}: cannot read its in-memory checkpoint slots ({e!r:.200})")
            return []

    def _read(self, slot: int) -> tuple[torch.Tensor, Any, Header]:
        """A slot's bytes, skeleton (our own node's memory, written by our job) and header."""
        region = self.regions[slot]
        header = region.header()
        data = region.data()
        return data, snapshot.read_skeleton(data, HEADER_SIZE, header.data_len, header.skeleton_len), header

    def _load(self, state: dict[str, Any], data: Any, base: int, skeleton: Any, *_: Any,
              trees: Any = None) -> str | None:
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

    def _unpublish_all(self) -> None:
        for region in self.regions + self.buddy_regions:
            with contextlib.suppress(OSError):
                region.unpublish()
        self._last = self._copied = self._unsettled = self._newest = self._armed = None


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


def _data_len(skeleton: Any) -> int:
    """The tensor bytes a skeleton's references span (the end of the last one)."""
    if isinstance(skeleton, snapshot.TensorRef):
        return skeleton.offset + skeleton.nbytes
    if isinstance(skeleton, dict):
        return max((_data_len(v) for v in skeleton.values()), default=0)
    if isinstance(skeleton, (list, tuple)):
        return max((_data_len(v) for v in skeleton), default=0)
    return 0
