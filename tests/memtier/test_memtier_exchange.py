"""The buddy copies' exchange (``memtier.exchange``) over its real streams (``memtier.conduit``):
two ranks' links in one process, connected on loopback and authenticated under a key, their
slots in two agents' memory files. What lands, when, and what never does; fast."""

from __future__ import annotations

import pickle
import socket
import threading
import time

import pytest
import torch

from elastic_harness.memtier import buddy
from elastic_harness.memtier.conduit import (
    Conduit,
    LinkSettings,
    decode_address,
    encode_address,
    local_address,
    proof,
)
from elastic_harness.memtier.exchange import BuddyLink
from elastic_harness.memtier.host import HostSlots, slot_paths
from elastic_harness.memtier.peer import SkeletonEncoder, decode_skeleton, encode_skeleton
from elastic_harness.memtier.region import Region
from elastic_harness.memtier.slots import HEADER_SIZE, Header
from elastic_harness.memtier.snapshot import capture_trees, pack, pack_skeleton, unpack

pytestmark = pytest.mark.timeout(60)

GEN = 0x5EED
DIGEST = b"g" * 32
KEY = b"k" * 32


class Gather:
    """``Wire.gather`` for ranks that are threads of this process: every rank's list, in rank order."""

    def __init__(self, n: int) -> None:
        self.values: list = [None] * n
        self.barrier = threading.Barrier(n, timeout=30)

    def __call__(self, rank: int, values: list[int]) -> list[list[int]]:
        self.values[rank] = values
        self.barrier.wait()
        out = list(self.values)
        self.barrier.wait()  # everyone read them before the next gather writes
        return out


def connect(n: int = 2, keys: list[bytes] | None = None, warn=None) -> list[Conduit | None]:
    """Every rank's streams of a ring of ``n`` (one node each), set up at once as the ranks do."""
    gather, out = Gather(n), [None] * n
    keys = keys or [KEY] * n

    def one(r: int) -> None:
        out[r] = Conduit.connect(LinkSettings(GEN, keys[r], "127.0.0.1", 20), rank=r, holder=(r - 1) % n,
                                 source=(r + 1) % n, gather=lambda v, r=r: gather(r, v),
                                 warn=warn or (lambda m: None))

    threads = [threading.Thread(target=one, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.fixture
def pair():
    """Two ranks' links, and each rank's own and buddy slots (two each) in its own agent's memory."""
    conduits = connect()
    hosts = [HostSlots.create(1, slots=4) for _ in range(2)]
    regions = [[Region(p) for p in slot_paths(h.describe(), 0)] for h in hosts]
    warnings: list[str] = []
    links = [BuddyLink(regions[r][2:], rank=r, world_size=2, local_size=1, generation=GEN, conduit=conduits[r],
                       warn=warnings.append) for r in range(2)]
    yield links, [rs[:2] for rs in regions], [rs[2:] for rs in regions], warnings
    for link in links:
        link.stop()
    for rs in regions:
        for r in rs:
            r.close()
    for h in hosts:
        h.close()


def snapshot(region: Region, step: int, rank: int, size: int) -> tuple[torch.Tensor, Header, dict[str, bytes]]:
    """Publish a snapshot of ``size`` tensor bytes (a pattern of the step and rank) into an own
    slot; its skeleton's pickled entries (``snapshot.Capture.parts``) with it."""
    parts = {"train": pickle.dumps({"step": step, "rank": rank}), "model": pickle.dumps({"w": [1, 2, 3]})}
    skeleton = pack(parts)
    data = region.begin(HEADER_SIZE + size + len(skeleton))
    data[HEADER_SIZE:HEADER_SIZE + size] = (torch.arange(size) * (step + 3 * rank)).to(torch.uint8)
    data[HEADER_SIZE + size:HEADER_SIZE + size + len(skeleton)] = torch.frombuffer(bytearray(skeleton),
                                                                                   dtype=torch.uint8)
    header = Header(True, step, 2, rank, size, len(skeleton), DIGEST, generation=GEN)
    region.publish(header)
    return data, header, parts


def exchange(links, own, step: int, sizes=(1000, 1000)) -> None:
    """Both ranks snapshot ``step`` into own slot ``step % 2`` and start the copies (as after a
    step whose all-reduce found no copy moving), then every receive lands."""
    for r, link in enumerate(links):
        link.settled()
        data, header, skeleton = snapshot(own[r][step % 2], step, r, sizes[r])
        link.start(step % 2, data, header, skeleton, limit=buddy.bound(10**6))
    settle(links)


def settle(links) -> None:
    deadline = time.monotonic() + 20
    while any(link.moving() for link in links):  # each poll moves what the sockets take
        assert time.monotonic() < deadline, "a receive never landed"


def published(regions) -> list[tuple[int, int]]:
    return sorted((h.step, h.data_len) for h in (r.header() for r in regions) if h is not None and h.published)


def test_a_copy_lands_byte_for_byte_in_the_holders_buddy_slot(pair):
    links, own, copies, warnings = pair
    exchange(links, own, 1)
    assert [published(c) for c in copies] == [[(1, 1000)], [(1, 1000)]]
    for holder, source in ((0, 1), (1, 0)):
        (slot,) = [r for r in copies[holder] if r.header() is not None and r.header().published]
        h = slot.header()
        assert (h.rank, h.world_size, h.generation, h.digest, h.replicated) == (source, 2, GEN, DIGEST, False)
        mine = own[source][1].data()[HEADER_SIZE:HEADER_SIZE + 1000]
        assert torch.equal(slot.data()[HEADER_SIZE:HEADER_SIZE + 1000], mine)
        raw = bytes(slot.data()[HEADER_SIZE + 1000:HEADER_SIZE + 1000 + h.skeleton_len].tolist())
        assert decode_skeleton(raw) == {"train": {"step": 1, "rank": source}, "model": {"w": [1, 2, 3]}}
    assert [link.held[0] for link in links] == [1, 1] and all(link.announce for link in links)
    assert all(link.cost_s and link.copy_cost_s() > 0 for link in links)
    assert not warnings


def test_a_grown_snapshot_lands_and_the_two_newest_copies_alternate_slots(pair):
    links, own, copies, warnings = pair
    exchange(links, own, 1)
    exchange(links, own, 2, sizes=(10_000, 1000))
    exchange(links, own, 3, sizes=(3_000_000, 1000))  # more than the sockets hold: over several polls
    assert published(copies[1]) == [(2, 10_000), (3, 3_000_000)]
    assert published(copies[0]) == [(2, 1000), (3, 1000)]
    (slot,) = [r for r in copies[1] if r.header().step == 3]
    assert torch.equal(slot.data()[HEADER_SIZE:HEADER_SIZE + 3_000_000], own[0][1].data()[HEADER_SIZE:HEADER_SIZE + 3_000_000])
    assert links[1].held == (3, 3_000_000 + slot.header().skeleton_len) and not warnings


def test_a_copy_in_flight_is_never_offered_and_its_own_slot_is_kept_until_sent(pair):
    links, own, copies, _ = pair
    exchange(links, own, 1)
    # Only rank 1 starts step 2's exchange, far larger than the sockets hold (rank 0 is stuck,
    # say, and reads nothing): its receive never lands, the slot it receives into stays
    # unpublished, the newest whole copy stays offered, and its own slot stays kept.
    data, header, skeleton = snapshot(own[1][0], 2, 1, 64 << 20)
    links[1].start(0, data, header, skeleton, limit=buddy.bound(10**9))
    assert links[1].moving() and links[1].busy()
    assert published(copies[1]) == [(1, 1000)]
    assert links[1].sending(0) and not links[1].sending(1), "the own slot being sent is not rewritten"


def test_a_bogus_announcement_breaks_the_link_and_publishes_nothing(pair):
    links, own, copies, warnings = pair
    links[0].world_size = 3  # rank 0 now expects a copy of another world size than rank 1 sends
    for r in (0, 1):
        links[r].start(1, *snapshot(own[r][1], 1, r, 1000), limit=buddy.bound(10**6))
    deadline = time.monotonic() + 20
    while not links[0].broken:
        assert time.monotonic() < deadline
        links[0].busy()
    assert links[0].busy() and not links[0].moving()
    assert published(copies[0]) == [] and "world size" in warnings[0]


def test_a_sender_that_dies_mid_copy_leaves_nothing_published_and_breaks_the_link(pair):
    links, own, copies, warnings = pair
    exchange(links, own, 1)
    data, header, skeleton = snapshot(own[1][0], 2, 1, 64 << 20)
    links[1].start(0, data, header, skeleton, limit=buddy.bound(10**9))
    links[0].start(0, *snapshot(own[0][0], 2, 0, 1000), limit=buddy.bound(10**9))
    links[0].busy()  # part of rank 1's copy arrived
    links[1].stop()  # rank 1 dies
    deadline = time.monotonic() + 20
    while not links[0].broken:
        assert time.monotonic() < deadline
        links[0].busy()
    assert published(copies[0]) == [(1, 1000)], "the half-received step 2 is never offered"
    assert "closed" in warnings[-1] or "broke" in warnings[-1]


# ----- the skeleton's JSON, entry by entry --------------------------------------------------

def test_the_skeleton_encoder_reuses_unchanged_entries_and_matches_a_full_encoding():
    enc = SkeletonEncoder()

    def parts(skeleton):
        return {k: pickle.dumps(v) for k, v in skeleton.items()}

    base = {"model": {"w": (1, 2)}, "optim": {"state": {0: {"lr": 0.1}}}, "train": {"step": 1}}
    assert enc.encode(parts(base)) == encode_skeleton(base)
    moved = {**base, "train": {"step": 2}}
    assert enc.encode(parts(moved)) == encode_skeleton(moved)
    changed = {**moved, "optim": {"state": {0: {"lr": 0.05}}}}
    assert enc.encode(parts(changed)) == encode_skeleton(changed)
    assert enc.encode(parts(base)) == encode_skeleton(base)  # back again: nothing stale kept


def test_a_capture_pickles_entry_by_entry_and_a_slot_reads_them_back_whole():
    t, u = torch.ones(3), torch.zeros(2)
    cap = capture_trees({"model": {"w": t, "tied": t}, "train": {"step": 4, "u": u}})
    assert set(cap.parts) == {"model", "train"} and cap.skeleton == pack(cap.parts)
    back = unpack(cap.skeleton)
    assert back["model"]["w"] == back["model"]["tied"]  # within an entry: one reference
    assert back["train"]["step"] == 4 and back["train"]["u"].offset == 64  # one byte layout across entries
    assert cap.data_len == 128 and len(cap.sources) == 2
    assert unpack(pack_skeleton(back)) == back
    with pytest.raises(ValueError, match="named entries"):
        pack_skeleton([1, 2])


# ----- the streams ---------------------------------------------------------------------------

def test_a_ring_of_three_links_up_and_a_wrong_key_keeps_no_link_on_any_rank():
    ring = connect(3)
    try:
        assert all(c is not None for c in ring)
        ring[0].offer([memoryview(b"hello")])
        assert ring[0].push()
        got = bytearray(5)
        deadline = time.monotonic() + 10
        n = 0
        while n < 5:
            assert time.monotonic() < deadline
            n += ring[2].pull_into(memoryview(got)[n:])  # rank 0's holder is rank 2
        assert bytes(got) == b"hello"
    finally:
        for c in ring:
            c.close()
    warnings: list[str] = []
    assert connect(3, keys=[KEY, KEY, b"x" * 32], warn=warnings.append) == [None, None, None]
    assert any("did not prove the job's key" in w for w in warnings)


@pytest.mark.parametrize("says", ["another hello", "nothing", "half a hello"])
def test_a_stranger_who_connects_first_is_never_taken_for_the_source_nor_holds_it_up(says):
    # A connection that does not say it is the source's is dropped, one that says nothing
    # (or stops halfway) is left waiting; the source's then proves the key, well within the
    # setup's deadline (a stranger read before the source would hold it to the deadline,
    # and the link would fail).
    import secrets

    strangers: list[socket.socket] = []

    def stranger(values: list[int]) -> None:
        s = socket.create_connection(decode_address(values), timeout=5)
        strangers.append(s)  # kept open until the links are up
        if says == "another hello":
            s.sendall(b"EHBC" + b"\0" * 24 + secrets.token_bytes(16))
        elif says == "half a hello":
            s.sendall(b"EHBC" + b"\0" * 8)

    gather, out = Gather(2), [None, None]
    warnings: list[str] = []
    first = threading.Event()  # the stranger is in rank 0's accept queue before rank 1 connects

    def one(r: int) -> None:
        def g(v: list[int], r=r) -> list[list[int]]:
            everyone = gather(r, v)
            if len(v) == 3:  # the addresses' gather
                if r == 0:
                    stranger(everyone[0])
                    first.set()
                else:
                    assert first.wait(10)
            return everyone
        out[r] = Conduit.connect(LinkSettings(GEN, KEY, "127.0.0.1", 8), rank=r, holder=1 - r, source=1 - r,
                                 gather=g, warn=warnings.append)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(c is not None for c in out), warnings
    finally:
        for s in strangers:
            s.close()
        for c in out:
            if c is not None:
                c.close()


def test_addresses_and_proofs():
    assert decode_address(encode_address("10.1.2.3", 4567)) == ("10.1.2.3", 4567)
    assert decode_address(encode_address("fe80::1", 80)) == ("fe80::1", 80)
    assert decode_address([0, 0, 0]) is None
    assert local_address("127.0.0.1") == "127.0.0.1"
    nonce = b"n" * 16
    p = proof(KEY, nonce, GEN, 1, 0, b"holder")
    assert p != proof(KEY, nonce, GEN, 1, 0, b"sender") and p != proof(KEY, nonce, GEN + 1, 1, 0, b"holder")
    assert p != proof(b"y" * 32, nonce, GEN, 1, 0, b"holder")


def test_a_copy_that_never_lands_is_given_up_and_own_snapshots_go_on(pair):
    from elastic_harness.memtier.peer import Wire
    from elastic_harness.memtier.tier import MemoryTier, Place

    links, own, copies, warnings = pair
    tier = MemoryTier(own[0], Place(0, 2, Wire(None, None, None), GEN), warn=warnings.append,
                      buddy_regions=copies[0], local_size=1)
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
