"""The worker's side of the in-memory tier: save a snapshot, restore the newest usable one.

Call order (every rank of a generation, same order): ``restore(state, layout)`` once,
before training and before any storage restore (it is collective, over ``wire``: the
checkpoint group); then ``save(step, state)`` after the steps ``cadence`` names (no
collective; each rank writes its own slot). Where a failing rank keeps its last step
(``memory_on_failure``): ``arm(step, state)`` after every step, ``disarm()`` when the state
starts to change (the optimizer's step), ``keep_armed()`` on the way down after a failure.
``close()`` at the end.

The tier keeps what outlives one restore: this rank's slots (which holds its newest
snapshot, which the buddy copies still need), the snapshots it saves, the step it is armed
with, and the buddy copies' link. The restore of one generation is an object of its own
(``memtier.restore.GenerationRestore``: plan, read, move pieces, exchange, load), which
``restore`` builds over these slots and runs once. A rank that cannot open its slots takes
part with none, so the ranks always agree.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from elastic_harness.errors import os_reason
from elastic_harness.memtier import buddy, peer, snapshot
from elastic_harness.memtier.choose import Plan
from elastic_harness.memtier.conduit import Conduit, LinkSettings
from elastic_harness.memtier.exchange import BuddyLink
from elastic_harness.memtier.host import SLOTS_PER_RANK, slot_paths
from elastic_harness.memtier.region import Region, unpublish
from elastic_harness.memtier.restore import GenerationRestore, Restored
from elastic_harness.memtier.slots import HEADER_SIZE, SLACK, Header

LINK_SETUP_S = 30.0  # the buddy copies' streams: connect and prove the key, every rank at once


@dataclass(frozen=True)
class Place:
    """What a generation hands its tier (the tier's slots outlive it): this rank, the world
    size, the wire the ranks' collectives go over, and the generation's number."""

    rank: int
    world_size: int
    wire: peer.Wire
    generation: int = 0


class MemoryTier:
    def __init__(self, regions: list[Region], place: Place, *, warn: Callable[[str], None],
                 buddy_regions: list[Region] | None = None, local_size: int = 0, link_key: bytes | None = None,
                 link_host: str = "127.0.0.1") -> None:
        self.regions, self.rank, self.world_size, self.wire = regions, place.rank, place.world_size, place.wire
        # The buddy copies' link (``conduit``): the job's key its ends prove, the address this
        # rank listens on. No key: no copies (the same on every rank: it comes from the job).
        self.link_key, self.link_host = link_key, link_host
        # Copies of another node's rank's snapshot (``buddy``); used under sharded state only.
        self.buddy_regions = buddy_regions or []
        self.local_size, self.generation = local_size, place.generation
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
        # ``newest``: the step of the newest snapshot this rank published.
        self._armed: tuple[int, snapshot.Capture] | None = None
        self.newest: int | None = None

    @classmethod
    def open(cls, described: str, local_rank: int, place: Place, *, warn: Callable[[str], None],
             local_size: int = 0, link_key: bytes | None = None, link_host: str = "127.0.0.1") -> MemoryTier:
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
            warn(f"rank {place.rank}: cannot open its in-memory checkpoint slots ({os_reason(e)}); "
                 "restarts restore from storage")
        own, spare = regions[:SLOTS_PER_RANK], regions[SLOTS_PER_RANK:]
        if link_key is None:
            for region in spare:
                region.close()
            spare = []
        return cls(own, place, warn=warn, buddy_regions=spare, local_size=local_size, link_key=link_key,
                   link_host=link_host)

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
        job = GenerationRestore(self.regions, self.buddy_regions, rank=self.rank, world_size=self.world_size,
                                wire=self.wire, warn=self._warn, rules=self.rules, last=self._last)
        try:
            restored = job.run(state, durable, t0)
        finally:
            self.plan, self._last = job.plan, job.last
            if job.unpublished:
                self._forget()
        if self.link_key is not None and buddy.active(self.world_size, self.local_size, self.rules.sharded):
            self.link = self._link()  # collective, as every input to the condition is the job's
        return restored

    def _link(self) -> BuddyLink | None:
        """Collective: the buddy copies' link, when every rank set its streams up (``conduit``)."""
        assert self.link_key is not None
        holder = buddy.holder_of(self.rank, self.world_size, self.local_size)
        source = buddy.source_of(self.rank, self.world_size, self.local_size)
        link = LinkSettings(self.generation, self.link_key, self.link_host, LINK_SETUP_S)
        conduit = Conduit.connect(link, rank=self.rank, holder=holder, source=source, gather=self.wire.gather,
                                  able=bool(self.buddy_regions), warn=self._warn)
        if conduit is None:
            return None
        return BuddyLink(self.buddy_regions, rank=self.rank, world_size=self.world_size, local_size=self.local_size,
                         generation=self.generation, conduit=conduit, warn=self._warn)

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
        self._last, self.newest = slot, step
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
        if step == self.newest:
            return step
        slot = buddy.writable(self._last, len(self.regions), set())
        try:
            if slot is None:
                return None
            self._put(slot, step, cap)  # only the slot written is unpublished if this fails
        except Exception:  # noqa: BLE001 - on the way down after another failure
            return None
        self._last, self.newest = slot, step
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

    def _unpublish_all(self) -> None:
        unpublish(self.regions + self.buddy_regions)
        self._forget()

    def _forget(self) -> None:
        """The slots were unpublished: none holds a snapshot this rank keeps, copies or armed."""
        self._last = self._copied = self._unsettled = self.newest = self._armed = None
