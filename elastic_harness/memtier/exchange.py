"""The buddy copies in flight (``buddy``): send this rank's snapshot to its holder, receive
its source's copy into a buddy slot, with no thread and without the step loop ever waiting.

A copy is one message on the pair's stream (``conduit``): the announcement
(``buddy.META_FIELDS`` int64: step, generation, world size, rank, sizes, digest), then the
tensor bytes straight out of the sender's published slot, then the skeleton as JSON
(``peer.encode_skeleton``: nothing received is ever unpickled). Every byte is moved by the
training thread in calls that return at once (``pump``: what the kernel's socket buffers
take and hold): ``start`` sends, and every rank reads its copy from the next step's hook on
(``busy``, which the step loop calls anyway), all ranks in the same step; no thread of ours
or of a library wakes up. Earlier designs paid for those
wake-ups: a copy thread (~4 ms a copy on a busy 2-core step, the GIL passed back and forth),
then gloo messages (~2 ms a copy: its loop threads on both ends, a ready notice before every
send), whatever the bytes (``bench buddy``).

One exchange (``start``, every rank at the same step, agreed in the step's all-reduce): the
own copy is queued on the stream to the holder (its slot is read, never copied, until the
last byte left: ``sending``), and a copy from the source is expected. The receiving side
reads the announcement, checks it (``buddy.acceptable``), then reads the tensor bytes and the
JSON straight into the buddy slot not holding the newest copy (``begin`` unpublished it)
and publishes it once every byte arrived. A copy whose sender died mid-way (the stream
closed) is never published, so never offered, and the link breaks: copies stop for the
generation.

``busy`` says whether this rank's receive is still moving or the link broke (the ranks agree
on it in the step's all-reduce before the next exchange, ``buddy.due``), ``moving`` whether
its receive is in flight.
"""

from __future__ import annotations

import statistics
import struct
import time
from collections import deque
from collections.abc import Callable

import torch

from elastic_harness.memtier import buddy, peer
from elastic_harness.memtier.conduit import Conduit, LinkError
from elastic_harness.memtier.region import Region
from elastic_harness.memtier.slots import HEADER_SIZE, Header, next_slot

_META = struct.Struct(f"<{buddy.META_FIELDS}q")


class BuddyLink:
    def __init__(self, regions: list[Region], *, rank: int, world_size: int, local_size: int, generation: int,
                 conduit: Conduit, warn: Callable[[str], None]) -> None:
        self.regions, self.rank, self.world_size, self.generation = regions, rank, world_size, generation
        self.holder = buddy.holder_of(rank, world_size, local_size)
        self.source = buddy.source_of(rank, world_size, local_size)
        self._conduit, self._warn = conduit, warn
        self._sending: int | None = None  # the own slot the stream still reads
        self._expect = False  # a copy from the source is due (an exchange started) and not landed
        self._head = bytearray(_META.size)  # its announcement, as it arrives
        self._head_got = 0
        self._meta: tuple[int, ...] = ()
        self._body: memoryview | None = None  # where its bytes go: the buddy slot's, past the header
        self._body_got = 0
        self._target: int | None = None  # the buddy slot receiving
        self._limit = 0
        self._encoder = peer.SkeletonEncoder()  # the skeleton as JSON, unchanged entries reused
        self._last: int | None = None  # the buddy slot holding the newest copy
        self.held: tuple[int, int] | None = None  # (step, bytes) of the newest copy held
        self.announce = False  # the generation's first copy arrived (reported once, then cleared)
        self.broken = False
        self.cost_s: deque[float] = deque(maxlen=16)  # seconds a copy held the training thread
        self.wall_s: deque[float] = deque(maxlen=16)  # start to landing seen (by the next poll)
        self._cost = 0.0  # this exchange's so far
        self._t0 = 0.0  # when it started
        self.last_step = 0  # the step of the last exchange started

    # ----- what the step loop asks ------------------------------------------------------------
    def busy(self) -> bool:
        """Is this rank's receive still moving, or the link broken? (Moves what it can.)"""
        self.pump()
        return self._expect or self.broken

    def moving(self) -> bool:
        """Is a receive still in flight here? (A broken link is busy but not moving.)"""
        self.pump()
        return self._expect

    def copy_cost_s(self) -> float:
        """The median seconds a copy holds the training thread, from its start to its landing
        (every call that moved its bytes): wall time, so what a busy machine adds counts too."""
        return statistics.median(self.cost_s) if self.cost_s else 0.0

    def sending(self, slot: int) -> bool:
        """Is own ``slot`` still read by the stream to the holder?"""
        self.pump()
        return self._sending == slot

    def settled(self) -> None:
        """No rank's copy is moving (the step's all-reduce): every holder read this rank's
        copy whole, so the stream has nothing left to send from the own slot."""
        self.pump()

    # ----- one exchange ----------------------------------------------------------------------
    def start(self, slot: int, data: torch.Tensor, header: Header, parts: dict[str, bytes], limit: int) -> None:
        """Expect the source's copy (up to ``limit`` bytes); send the own ``slot`` (its bytes
        ``data``, published with ``header``; ``parts`` its skeleton's pickled entries, our own
        bytes, ``snapshot.Capture.parts``) to the holder. Every rank calls it at the same
        step, with no copy moving anywhere."""
        if self.broken:
            return
        self._t0 = time.perf_counter()
        self._cost = 0.0
        self._limit = limit
        self.last_step = header.step
        raw = self._encoder.encode(parts)
        d = header.digest.ljust(32, b"\0")[:32]
        meta = _META.pack(buddy.MAGIC, header.step, self.generation, self.world_size, self.rank, header.data_len,
                          len(raw), *struct.unpack("<4q", d))
        body = data[HEADER_SIZE:HEADER_SIZE + header.data_len]
        self._sending = slot
        self._conduit.offer([memoryview(meta), memoryview(body.numpy()), memoryview(raw)])
        self._expect, self._head_got, self._body, self._body_got = True, 0, None, 0
        self._cost = time.perf_counter() - self._t0
        self.pump(receive=False)

    def pump(self, receive: bool = True) -> None:
        """Move what the streams take and hold now; land a copy whose last byte arrived.
        ``start`` only sends: every rank then reads its copy in the next step's hook, in
        step with the others (a rank reading it at once, because its source started
        first, would make the ranks' extra work fall in different steps, and each rank's
        delays everyone at the next collective)."""
        if self.broken or not (self._expect or self._sending is not None):
            return
        t0 = time.perf_counter()
        landed = False
        try:
            if self._sending is not None and self._conduit.push():
                self._sending = None
            if self._expect and receive:
                landed = self._receive()
        except (LinkError, OSError) as e:  # OSError: the buddy slot could not be resized
            self._break(str(e), self.last_step)
        now = time.perf_counter()
        self._cost += now - t0
        if landed:
            self.cost_s.append(self._cost)
            self.wall_s.append(now - self._t0)

    def _receive(self) -> bool:
        """Read what arrived of the source's copy; True when it landed (published)."""
        if self._head_got < _META.size:
            self._head_got += self._conduit.pull_into(memoryview(self._head)[self._head_got:])
            if self._head_got < _META.size:
                return False
            self._meta = _META.unpack(bytes(self._head))
            problem = buddy.acceptable(list(self._meta), world_size=self.world_size, source=self.source,
                                       limit=self._limit)
            if problem:
                raise LinkError(problem)
            data_len, json_len = self._meta[5], self._meta[6]
            self._target = next_slot(self._last, len(self.regions))
            slot = self.regions[self._target].begin(HEADER_SIZE + data_len + json_len)  # unpublished first
            self._body = memoryview(slot.numpy())[HEADER_SIZE:HEADER_SIZE + data_len + json_len]
        assert self._body is not None
        self._body_got += self._conduit.pull_into(self._body[self._body_got:])
        if self._body_got < self._body.nbytes:
            return False
        self._land()
        return True

    def _land(self) -> None:
        """Every byte of the copy arrived: publish it."""
        step, generation, world, rank, data_len, json_len = self._meta[1:7]
        target = self._target
        assert target is not None
        digest = struct.pack("<4q", *self._meta[7:11])
        self.regions[target].publish(Header(True, step, world, rank, data_len, json_len, digest,
                                            replicated=False, generation=generation))
        self._last = target
        self._expect, self._body = False, None
        self.announce = self.announce or self.held is None
        self.held = (step, data_len + json_len)

    def _break(self, problem: str, step: int) -> None:
        self.broken = True
        self._expect, self._body, self._sending = False, None, None
        self._conduit.close()
        self._warn(f"rank {self.rank}: no buddy copy of rank {self.source} at step {step} ({problem}); "
                   "copies stop for this generation")

    # ----- the end ---------------------------------------------------------------------------
    def close(self, timeout: float) -> None:
        """At a normal end (every rank there, having started the same copies): let this rank's
        receive land and its send leave, up to ``timeout`` in all."""
        deadline = time.monotonic() + timeout
        while (self._expect or self._sending is not None) and not self.broken and time.monotonic() < deadline:
            self.pump()
            time.sleep(0.001)  # the streams have no wake-up of ours to wait on
        self.stop()

    def stop(self) -> None:
        """Close the streams (a copy not whole stays unpublished)."""
        self._conduit.close()
        self._expect, self._body, self._sending = False, None, None
