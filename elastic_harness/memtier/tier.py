"""The worker's side of the in-memory tier: save a snapshot, restore the newest usable one.

Call order (every rank of a generation, same order): ``restore(state, replicated=...)`` once,
before training and before any storage restore (it is collective, over ``wire``: the
checkpoint group); then ``save(step, state)`` after the steps ``cadence`` names (no
collective; each rank writes its own slot). ``close()`` at the end.

``restore`` gathers every rank's offers (the published snapshots in its slots) once and
follows ``choose``: every rank reads the snapshot it wrote itself at this world size (a
worker crash); or, when the state is replicated (DDP), the newest step any rank holds, at
any world size: its holders read their own slot, the other ranks receive it from a holder
(``peer``: its tensor bytes into their own slot, its skeleton as JSON; nothing received is
unpickled); or storage, and then every rank's slots are unpublished (they belong to a
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
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from elastic_harness.memtier import peer, snapshot
from elastic_harness.memtier.choose import MEMORY, PEER, STORAGE, Plan, choose, offers_of
from elastic_harness.memtier.host import slot_paths
from elastic_harness.memtier.region import Region
from elastic_harness.memtier.slots import HEADER_SIZE, Header, next_slot

SLACK = 4096


@dataclass(frozen=True)
class Restored:
    step: int
    seconds: float
    source: str = MEMORY  # MEMORY (own slot on every rank) or PEER (some ranks received it)
    senders: tuple[int, ...] = ()  # PEER: the ranks that sent it
    receivers: int = 0  # PEER: how many ranks received it
    saved_world_size: int | None = None  # of the generation that wrote it


def restored_message(r: Restored, saved_world_size: int | None, world_size: int) -> str:
    """Pure: the ``resume`` event's line for a restore from memory."""
    sizes = (f"world size {world_size}" if saved_world_size in (None, world_size)
             else f"saved at world size {saved_world_size}, now {world_size}")
    via = (f", {r.receivers} rank(s) received it from rank(s) {', '.join(map(str, r.senders))}"
           if r.source == PEER else "")
    return f"restored from {r.source} at step {r.step} ({sizes}{via}), took {r.seconds:.3f} s"


class MemoryTier:
    def __init__(self, regions: list[Region], *, rank: int, world_size: int, wire: peer.Wire,
                 warn: Callable[[str], None]) -> None:
        self.regions, self.rank, self.world_size, self.wire = regions, rank, world_size, wire
        self._warn = warn  # every rank may report its own trouble
        self._last: int | None = None  # the slot holding this rank's newest snapshot
        self._views = [snapshot.Views() for _ in regions]
        self.replicated = False  # snapshots are marked replicated (``restore`` learns it)
        self.plan: Plan | None = None  # the last restore's

    @classmethod
    def open(cls, described: str, local_rank: int, *, rank: int, world_size: int, wire: peer.Wire,
             warn: Callable[[str], None]) -> MemoryTier:
        """This rank's slots from the agent's description (``host.describe``)."""
        regions: list[Region] = []
        try:
            for path in slot_paths(described, local_rank):
                regions.append(Region(path))
        except OSError as e:
            for region in regions:
                region.close()
            regions = []
            warn(f"rank {rank}: cannot open its in-memory checkpoint slots ({e.strerror or e!r}); "
                 "restarts restore from storage")
        return cls(regions, rank=rank, world_size=world_size, wire=wire, warn=warn)

    def restore(self, state: dict[str, Any], *, replicated: bool = False) -> Restored | None:
        """Collective: fill ``state`` from memory (own or a peer's, ``choose``), or None.
        ``replicated``: the job's state is a full replica on every rank
        (``peer.replicated_layout``); snapshots saved from now on are marked so."""
        t0 = time.perf_counter()
        self.replicated = replicated
        headers = self._headers()
        everyone = [peer.decode_offers(v) for v in self.wire.gather(peer.encode_offers(offers_of(headers)))]
        plan = self.plan = choose(everyone, world_size=self.world_size, replicated=replicated)
        if plan.source == STORAGE:
            if self.rank == 0 and any(everyone):
                self._warn(f"the in-memory tier cannot restore this generation ({plan.reason}); "
                           "restoring from storage")
            self._unpublish_all()
            return None
        slot = self._slot_for(plan, headers)
        senders = plan.senders(self.world_size)
        expect = self._expected(plan, state) if self.rank in senders else None
        if senders:  # the layout is agreed before a byte moves
            mismatch = [r for r, (bad,) in enumerate(self.wire.gather([int(isinstance(expect, str))])) if bad]
            if mismatch:
                self._warn(f"rank {self.rank}: not receiving step {plan.step} from a peer: rank(s) {mismatch} "
                           f"have another layout{f' ({expect})' if isinstance(expect, str) else ''}; "
                           "restoring from storage")
                self._unpublish_all()
                return None
        got, problem = self._exchange(plan, slot, senders, expect)
        failed = [r for r, (bad,) in enumerate(self.wire.gather([int(problem is not None)])) if bad]
        if failed:  # nothing was loaded yet: every rank falls back to storage
            if problem:
                self._warn(f"rank {self.rank}: receiving step {plan.step} from a peer failed ({problem})")
            self._unpublish_all()
            return None
        error = self._load(state, *got)
        failed = [r for r, (bad,) in enumerate(self.wire.gather([int(error is not None)])) if bad]
        if failed:
            self._unpublish_all()
            raise RuntimeError(f"restoring step {plan.step} from memory failed on rank(s) {failed} "
                               f"({f'rank {self.rank}: {error}' if error else 'see their warnings'}); "
                               "the next restart restores from storage")
        self._last = self._keep(plan, slot, got)
        return Restored(plan.step, time.perf_counter() - t0, plan.source, tuple(sorted(set(senders.values()))),
                        len(senders))

    def _slot_for(self, plan: Plan, headers: list[Header | None]) -> int | None:
        """This rank's slot holding the plan's snapshot; None for a receiver."""
        if self.rank not in plan.holders:
            return None
        for slot, h in enumerate(headers):
            if h is None or not h.published or h.step != plan.step:
                continue
            if (plan.same_layout and (h.world_size, h.rank) == (self.world_size, self.rank)
                    or not plan.same_layout and h.replicated and h.digest == plan.digest):
                return slot
        raise AssertionError("a holder without its snapshot")  # the plan came from these headers

    def _expected(self, plan: Plan, state: dict[str, Any]) -> int | str:
        """A receiver: the tensor bytes its live state takes, if its layout digest is the
        plan's; else why not. (Every rank loads once the plan is agreed, so taking the live
        state dicts here creates an empty optimizer's state only where it is restored.)"""
        try:
            mine = snapshot.capture_trees(snapshot.targets(state))
        except Exception as e:  # noqa: BLE001 - agreed on by every rank
            return f"{e!r:.200}"
        return mine.data_len if mine.digest == plan.digest else "its state's layout digest differs"

    def _exchange(self, plan: Plan, slot: int | None, senders: dict[int, int],
                  expect: int | str | None) -> tuple[tuple, str | None]:
        """Send the snapshot to this rank's receivers, or receive it from its sender: the
        snapshot to load, as (data, base, skeleton, data_len, local skeleton bytes), and the
        problem that stops this rank from restoring it (then nothing was loaded anywhere)."""
        if slot is not None:
            try:
                data, skeleton, header = self._read(slot)
            except Exception as e:  # noqa: BLE001 - agreed on by every rank
                data, skeleton, header, problem = None, None, None, f"{e!r:.300}"
            else:
                problem = None
            receivers = [r for r, s in senders.items() if s == self.rank]
            if receivers:
                self._send(receivers, data, skeleton, header)
            return (data, HEADER_SIZE, skeleton, 0, b""), problem
        return self._receive(plan, senders[self.rank], expect)

    def _send(self, receivers: list[int], data: Any, skeleton: Any, header: Header | None) -> None:
        try:
            raw = peer.encode_skeleton(skeleton) if header is not None else b""
        except snapshot.Unsupported as e:
            self._warn(f"rank {self.rank}: cannot send its snapshot to peers ({e})")
            raw = b""
        ok = bool(raw) and len(raw) <= peer.MAX_SKELETON
        for r in receivers:
            meta = torch.tensor([int(ok), header.data_len if ok else 0, len(raw) if ok else 0], dtype=torch.int64)
            self.wire.send(meta, r)
            if ok:
                self.wire.send(torch.frombuffer(bytearray(raw), dtype=torch.uint8), r)
                if header.data_len:
                    self.wire.send(data[HEADER_SIZE:HEADER_SIZE + header.data_len], r)

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
            local = pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL)  # our own bytes, for our slot
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            skeleton, local, problem = None, b"", f"its skeleton is malformed ({e!r:.200})"
        data, base = self._room(data_len + len(local))
        if data_len:
            self.wire.recv(data[base:base + data_len], src)  # straight into this rank's slot
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
        self.regions[target].publish(Header(True, plan.step, self.world_size, self.rank, data_len, len(local),
                                            plan.digest, replicated=True))
        return target

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Snapshot ``state`` as ``step`` into the slot not holding this rank's newest one."""
        if not self.regions:
            return
        slot = next_slot(self._last, len(self.regions))
        region = self.regions[slot]
        try:
            cap = snapshot.capture(state)
            # Room to spare: the skeleton (plain values such as a learning rate) may grow a little.
            data = region.begin(HEADER_SIZE + cap.data_len + len(cap.skeleton) + SLACK, pin=not cap.cpu)
            snapshot.write(cap, data, HEADER_SIZE, self._views[slot])
            region.publish(Header(True, step, self.world_size, self.rank, cap.data_len, len(cap.skeleton),
                                  cap.digest, replicated=self.replicated and not cap.sharded))
        except (OSError, snapshot.Unsupported, RuntimeError) as e:
            self._warn(f"rank {self.rank}: in-memory checkpoint at step {step} failed ({e!r:.200}); "
                       "the tier is off for this worker, restarts restore from storage")
            self._unpublish_all()
            self.close()
            return
        self._last = slot

    def close(self) -> None:
        for region in self.regions:
            region.close()
        self.regions = []

    def _headers(self) -> list[Header | None]:
        try:
            return [r.header() for r in self.regions]
        except OSError as e:
            self._warn(f"rank {self.rank}: cannot read its in-memory checkpoint slots ({e!r:.200})")
            return []

    def _read(self, slot: int) -> tuple[torch.Tensor, Any, Header]:
        """A slot's bytes, skeleton (our own node's memory, written by our job) and header."""
        region = self.regions[slot]
        header = region.header()
        data = region.data()
        return data, snapshot.read_skeleton(data, HEADER_SIZE, header.data_len, header.skeleton_len), header

    def _load(self, state: dict[str, Any], data: Any, base: int, skeleton: Any, *_: Any) -> str | None:
        """Fill ``state`` from a snapshot's bytes and skeleton; why it failed, or None."""
        try:
            trees = snapshot.targets(state)
            misfit = snapshot.misfit(skeleton, trees)
            if misfit:
                return f"the snapshot does not fit this state's layout ({misfit})"
            snapshot.restore_into(state, trees, skeleton, data, base)
        except Exception as e:  # noqa: BLE001 - reported to every rank, which then all stop
            return f"{e!r:.300}"
        return None

    def _unpublish_all(self) -> None:
        for region in self.regions:
            with contextlib.suppress(OSError):
                region.unpublish()
        self._last = None
