"""The buddy copies' exchange (``memtier.exchange``) over real gloo: two ranks' process groups
in one process (each on its own loopback pairs, as two nodes' would be), their slots in two
agents' memory files. What lands, when, and what never does; fast."""

from __future__ import annotations

import datetime as dt
import pickle
import threading
import time

import pytest
import torch
import torch.distributed as dist

from elastic_harness.memtier import buddy
from elastic_harness.memtier.exchange import BuddyLink
from elastic_harness.memtier.host import HostSlots, slot_paths
from elastic_harness.memtier.peer import COPY_TAG, SkeletonEncoder, decode_skeleton, encode_skeleton
from elastic_harness.memtier.region import Region
from elastic_harness.memtier.slots import HEADER_SIZE, Header

pytestmark = pytest.mark.timeout(60)

GEN = 0x5EED
DIGEST = b"g" * 32


@pytest.fixture
def pair():
    """Two gloo process groups of world size 2 in this process, and each rank's own and buddy
    slots (two each) in its own agent's memory."""
    store = dist.HashStore()
    groups: dict[int, object] = {}

    def make(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, dt.timedelta(seconds=30))

    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    hosts = [HostSlots.create(1, slots=4) for _ in range(2)]
    regions = [[Region(p) for p in slot_paths(h.describe(), 0)] for h in hosts]
    warnings: list[str] = []
    links = [BuddyLink(regions[r][2:], rank=r, world_size=2, local_size=1, generation=GEN,
                       isend=lambda t, dst, g=groups[r]: g.send([t], dst, COPY_TAG),
                       irecv=lambda t, src, g=groups[r]: g.recv([t], src, COPY_TAG),
                       warn=warnings.append) for r in range(2)]
    yield links, [rs[:2] for rs in regions], [rs[2:] for rs in regions], warnings
    for link in links:
        link.stop()
    for rs in regions:
        for r in rs:
            r.close()
    for h in hosts:
        h.close()


def snapshot(region: Region, step: int, rank: int, size: int) -> tuple[torch.Tensor, Header, bytes]:
    """Publish a snapshot of ``size`` tensor bytes (a pattern of the step and rank) into an own slot."""
    skeleton = pickle.dumps({"train": {"step": step, "rank": rank}, "model": {"w": [1, 2, 3]}})
    data = region.begin(HEADER_SIZE + size + len(skeleton))
    data[HEADER_SIZE:HEADER_SIZE + size] = (torch.arange(size) * (step + 3 * rank)).to(torch.uint8)
    data[HEADER_SIZE + size:HEADER_SIZE + size + len(skeleton)] = torch.frombuffer(bytearray(skeleton),
                                                                                   dtype=torch.uint8)
    header = Header(True, step, 2, rank, size, len(skeleton), DIGEST, generation=GEN)
    region.publish(header)
    return data, header, skeleton


def exchange(links, own, step: int, sizes=(1000, 1000)) -> None:
    """Both ranks snapshot ``step`` into own slot ``step % 2`` and start the copies (as after a
    step whose all-reduce found no copy moving), then every receive lands."""
    for r, link in enumerate(links):
        link.settled()
        data, header, skeleton = snapshot(own[r][step % 2], step, r, sizes[r])
        link.start(step % 2, data, header, skeleton, limit=buddy.bound(10**6))
    deadline = time.monotonic() + 20
    while any(link.moving() for link in links):  # gloo's threads move the bytes
        assert time.monotonic() < deadline, "a receive never landed"
        time.sleep(0.001)


def published(regions) -> list[tuple[int, int]]:
    return sorted((h.step, h.data_len) for h in (r.header() for r in regions) if h is not None and h.published)


def test_the_first_exchange_sizes_the_next_and_a_whole_copy_lands_byte_for_byte(pair):
    links, own, copies, warnings = pair
    exchange(links, own, 1)
    assert [published(c) for c in copies] == [[], []], "the sizing exchange publishes nothing"
    exchange(links, own, 2)
    assert [published(c) for c in copies] == [[(2, 1000)], [(2, 1000)]]
    for holder, source in ((0, 1), (1, 0)):
        (slot,) = [r for r in copies[holder] if r.header() is not None and r.header().published]
        h = slot.header()
        assert (h.rank, h.world_size, h.generation, h.digest, h.replicated) == (source, 2, GEN, DIGEST, False)
        mine = own[source][0].data()[HEADER_SIZE:HEADER_SIZE + 1000]
        assert torch.equal(slot.data()[HEADER_SIZE:HEADER_SIZE + 1000], mine)
        raw = bytes(slot.data()[HEADER_SIZE + 1000:HEADER_SIZE + 1000 + h.skeleton_len].tolist())
        assert decode_skeleton(raw) == {"train": {"step": 2, "rank": source}, "model": {"w": [1, 2, 3]}}
    assert [link.held[0] for link in links] == [2, 2] and all(link.announce for link in links)
    assert not warnings


def test_a_grown_snapshot_is_sized_first_and_the_newest_whole_copy_stays_offered(pair):
    links, own, copies, warnings = pair
    exchange(links, own, 1)
    exchange(links, own, 2)
    # Rank 0's snapshot grows past the room agreed: its copy of step 3 only sizes the next one
    # (gloo would abort a holder sent more than it posted), rank 1's lands as usual.
    exchange(links, own, 3, sizes=(10_000, 1000))
    assert published(copies[1]) == [(2, 1000)], "rank 1 still offers rank 0's step 2"
    assert published(copies[0]) == [(2, 1000), (3, 1000)]
    exchange(links, own, 4, sizes=(10_000, 1000))
    assert published(copies[1]) == [(2, 1000), (4, 10_000)]
    assert links[1].held[0] == 4 and not warnings


def test_a_copy_in_flight_is_never_offered_and_its_sends_are_kept_until_settled(pair):
    links, own, copies, _ = pair
    exchange(links, own, 1)
    exchange(links, own, 2)
    # Only rank 1 starts step 3's exchange (rank 0 is gone, say): its receive never lands,
    # the slot it receives into is unpublished and the newest whole copy stays offered.
    links[1].settled()
    data, header, skeleton = snapshot(own[1][1], 3, 1, 1000)
    links[1].start(1, data, header, skeleton, limit=buddy.bound(10**6))
    assert links[1].moving() and links[1].busy()
    assert published(copies[1]) == [(2, 1000)]
    assert links[1].sending(1) and not links[1].sending(0), "the own slot being sent is not rewritten"


def test_a_bogus_announcement_breaks_the_link_and_publishes_nothing(pair):
    links, own, copies, warnings = pair
    links[0].world_size = 3  # rank 0 now expects a copy of another world size than rank 1 sends
    exchange(links, own, 1)
    assert links[0].broken and links[0].busy() and not links[0].moving()
    assert published(copies[0]) == [] and "world size" in warnings[0]


# ----- the skeleton's JSON, entry by entry --------------------------------------------------

def test_the_skeleton_encoder_reuses_unchanged_entries_and_matches_a_full_encoding():
    enc = SkeletonEncoder()
    base = {"model": {"w": (1, 2)}, "optim": {"state": {0: {"lr": 0.1}}}, "train": {"step": 1}}
    assert enc.encode(base) == encode_skeleton(base)
    moved = {**base, "train": {"step": 2}}
    assert enc.encode(moved) == encode_skeleton(moved)
    changed = {**moved, "optim": {"state": {0: {"lr": 0.05}}}}
    assert enc.encode(changed) == encode_skeleton(changed)
    assert enc.encode([1, 2]) == encode_skeleton([1, 2])  # not a dict of entries: encoded whole


# ----- the copies' own group, at idle priority ---------------------------------------------

def test_the_copies_group_runs_its_own_gloo_threads_at_idle_priority_and_no_other():
    import os

    from elastic_harness.runtime.dist import background_group

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        before = {int(t) for t in os.listdir("/proc/self/task")}
        group = background_group(dt.timedelta(seconds=30))
        new = {int(t) for t in os.listdir("/proc/self/task")} - before
        policies = {tid: os.sched_getscheduler(tid) for tid in new}
        assert os.SCHED_IDLE in policies.values(), "the group's gloo threads were not lowered"
        assert all(os.sched_getscheduler(tid) == os.SCHED_OTHER for tid in before
                   if os.path.exists(f"/proc/self/task/{tid}")), "a thread that existed before was touched"
        t = torch.ones(3)
        dist.all_reduce(t, group=group)  # still a working group
        assert t.tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()


def test_sends_a_holder_never_took_break_the_link_instead_of_holding_the_step(pair):
    links, own, copies, warnings = pair
    # Rank 1 posts nothing (its link broke before it could): rank 0's sends are never taken.
    # Told that no copy is moving (a broken link is not), rank 0 gives them a grace, then
    # stops copies rather than wait on them.
    data, header, skeleton = snapshot(own[0][1], 1, 0, 1000)
    links[0].start(1, data, header, skeleton, limit=buddy.bound(10**6))
    links[0].settled()
    assert links[0].broken and "sending to rank 1" in warnings[0]
    assert not links[0].sending(1)


def test_a_copy_that_never_lands_is_given_up_and_own_snapshots_go_on(pair):
    from elastic_harness.memtier.peer import Wire
    from elastic_harness.memtier.tier import MemoryTier

    links, own, copies, warnings = pair
    tier = MemoryTier(own[0], rank=0, world_size=2, wire=Wire(None, None, None), warn=warnings.append,
                      buddy_regions=copies[0], local_size=1, generation=GEN)
    tier.link = links[0]
    state = {"model": {"w": torch.arange(4.0)}}
    # Step 1's copy goes both ways and lands; then rank 1 stops taking part: the copy of step 2
    # stays in flight, every later snapshot is told a copy still moves (``settled`` False),
    # and the own slots of steps 1 (copied) and 2 (being copied) are both held.
    assert tier.save(1, state, send=True, settled=True)
    links[1].start(0, *snapshot(own[1][0], 1, 1, 16), limit=buddy.bound(10**6))
    deadline = time.monotonic() + 20
    while links[0].moving() or links[1].moving():
        assert time.monotonic() < deadline, "a receive never landed"
        time.sleep(0.001)
    assert tier.save(2, state, send=True, settled=True)
    saved = [tier.save(step, state, settled=False) for step in range(3, 4 + buddy.STUCK_SNAPSHOTS)]
    assert not any(saved[:-1]), "the own slots are held while the copy is in flight"
    assert tier.link is None and "copies stop" in warnings[-1]
    assert saved[-1] and tier.save(201, state, settled=False), "given up: snapshots go on"
    steps = sorted(h.step for h in (r.header() for r in own[0]) if h is not None and h.published)
    assert steps == [3 + buddy.STUCK_SNAPSHOTS, 201]
