"""The buddy copies in flight (``buddy``): send this rank's snapshot to its holder, receive
its source's copy into a buddy slot, with no thread of ours and without the step loop ever
waiting on either.

Everything runs on the training thread, in a few calls that return at once; gloo's own
threads move the bytes (in the harness, those of the copies' own group, at idle CPU
priority: ``runtime.dist.background_group``). A copy thread (the previous design) cost a step ~4 ms per copy on a
busy 2-core machine for ~1 ms of its own CPU: each of its wake-ups took the GIL from the
training thread, which then waited for it back (``bench buddy``).

One exchange (``start``, every rank at the same step, agreed in the step's all-reduce):

- receives are posted first, two, sized as the previous copy agreed (``buddy.room``): the
  tensor bytes straight into the buddy slot not holding the newest copy (``begin``
  unpublished it), and a tail: the skeleton's JSON (``peer.encode_skeleton``: nothing
  received is ever unpickled) padded to its room, then the announcement
  (``buddy.META_FIELDS`` int64), into a scratch buffer;
- then the two sends to the holder: the tensor bytes straight out of this rank's published
  slot (or nothing, when they or the JSON do not fit the sizes agreed: gloo takes a message
  shorter than the receive posted for it, never a longer one, which aborts the receiving
  process) and the tail. The announcement also carries the sizes this snapshot needs: both
  ends take the next exchange's sizes from it.

The announcement ends the pair's last message, so its first field (``buddy.MAGIC``, zeroed
before the receive) showing up means every byte before it arrived: ``busy`` checks that one
int (gloo's works say they completed only inside a blocking ``wait``), then waits on the
receives (returning at once), checks the announcement (``buddy.acceptable``), moves the JSON
behind the tensor bytes and publishes the slot. Every message costs gloo's threads a few
wake-ups on each side, so an exchange sends as few as it can. A copy whose sender died
mid-way is never published, so never offered. The first exchange of a generation, and any
whose sizes grew, carries only the announcement (a sizing exchange; nothing is published).

A rank's sends are complete once every holder's receive landed: ``settled`` (no rank reported
copies moving in a step's all-reduce) collects their works; until then the own slot they
read is kept (``sending``). ``busy`` says whether this rank's receive is still moving or the
link broke (the ranks agree on it in the step's all-reduce before the next exchange,
``buddy.due``), ``moving`` whether its receive is in flight.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import pickle
import statistics
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from elastic_harness.memtier import buddy, peer
from elastic_harness.memtier.region import Region
from elastic_harness.memtier.slots import HEADER_SIZE, Header, next_slot

_EMPTY = torch.empty(0, dtype=torch.uint8)
_META_BYTES = 8 * buddy.META_FIELDS
_ABANDONED: list = []  # works left in flight by ``stop``, with what they read and write
SEND_GRACE = dt.timedelta(seconds=1)  # ``settled``: a complete send returns at once


class BuddyLink:
    def __init__(self, regions: list[Region], *, rank: int, world_size: int, local_size: int, generation: int,
                 isend: Callable[[torch.Tensor, int], Any], irecv: Callable[[torch.Tensor, int], Any],
                 warn: Callable[[str], None]) -> None:
        self.regions, self.rank, self.world_size, self.generation = regions, rank, world_size, generation
        self.holder = buddy.holder_of(rank, world_size, local_size)
        self.source = buddy.source_of(rank, world_size, local_size)
        self._isend, self._irecv, self._warn = isend, irecv, warn
        # The sizes agreed for the next exchange's messages: (tensor bytes, JSON bytes), the
        # same on both ends of a pair (``buddy.room`` of what the last announcement needed).
        self._room_out = (0, 0)  # to the holder
        self._room_in = (0, 0)  # from the source
        self._sends: list[Any] = []  # the sends' works, collected once settled
        self._keep: list[torch.Tensor] = []  # what the sends read, alive until they complete
        self._sending: int | None = None  # the own slot being sent
        self._recv: list[Any] = []  # the receive's works (tensor bytes, tail)
        self._tail = torch.zeros(_META_BYTES, dtype=torch.uint8)  # the tail received: JSON room, announcement
        self._meta = self._tail.view(torch.int64)  # the announcement, within ``_tail``
        self._target: int | None = None  # the buddy slot receiving
        self._limit = 0
        self._skeleton: tuple[bytes, bytes] | None = None  # the last pickled skeleton and its JSON
        self._encoder = peer.SkeletonEncoder()
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
        """Is this rank's receive still moving, or the link broken? (Lands what arrived.)"""
        if self._recv and int(self._meta[0]) == buddy.MAGIC:
            self._land()
        return bool(self._recv) or self.broken

    def moving(self) -> bool:
        """Is a receive still in flight here? (A broken link is busy but not moving.)"""
        self.busy()
        return bool(self._recv)

    def copy_cost_s(self) -> float:
        """The median seconds a copy holds the training thread, start and landing (0 before one):
        wall time, so what a busy machine adds to that work counts too."""
        return statistics.median(self.cost_s) if self.cost_s else 0.0

    def sending(self, slot: int) -> bool:
        """Is own ``slot`` still read by a send not known complete (``settled``)?"""
        return self._sending == slot

    def settled(self) -> None:
        """No rank's copy is moving (the step's all-reduce): every holder received this rank's
        messages, so its sends are complete; collect them. (A holder whose link broke is not
        moving either: a send it never took is given ``SEND_GRACE``, then the link breaks
        here too instead of the step waiting on it. The copies' group is theirs alone.)"""
        if self._sends and not self.broken:
            try:
                for w in self._sends:
                    w.wait(SEND_GRACE)  # complete: returns at once
            except Exception as e:  # noqa: BLE001 - never taken: copies stop, the step goes on
                _ABANDONED.append((self._sends, self._keep))
                self._sends = []
                self._break(f"sending to rank {self.holder}: {e!r:.200}", self.last_step)
        elif self._sends:  # a broken link's: maybe never taken, kept (``stop``)
            _ABANDONED.append((self._sends, self._keep))
        self._sends, self._keep, self._sending = [], [], None

    # ----- one exchange ----------------------------------------------------------------------
    def start(self, slot: int, data: torch.Tensor, header: Header, skeleton: bytes, limit: int) -> None:
        """Receive the source's copy (up to ``limit`` bytes); send the own ``slot`` (its bytes
        ``data``, published with ``header``; ``skeleton`` its pickled skeleton, our own bytes)
        to the holder. Every rank calls it at the same step, with no copy moving anywhere."""
        self._t0 = time.perf_counter()
        self.settled()
        self._limit = limit
        self.last_step = header.step
        try:
            self._post_receive()
        except Exception as e:  # noqa: BLE001 - this rank then sends nothing either: copies stop
            self._break(f"receiving: {e!r:.200}", header.step)
            return
        try:
            self._post_sends(slot, data, header, skeleton)
        except Exception as e:  # noqa: BLE001 - the holder then waits in vain: copies stop (``busy``)
            self._break(f"sending: {e!r:.200}", header.step)
        self._cost = time.perf_counter() - self._t0

    def _post_receive(self) -> None:
        room_data, room_json = self._room_in
        target = next_slot(self._last, len(self.regions))
        data = self.regions[target].begin(HEADER_SIZE + room_data + room_json)  # unpublished first
        if self._tail.numel() != room_json + _META_BYTES:
            self._tail = torch.empty(room_json + _META_BYTES, dtype=torch.uint8)
            self._meta = self._tail[room_json:].view(torch.int64)
        self._meta.zero_()
        self._target = target
        self._recv = [self._irecv(data[HEADER_SIZE:HEADER_SIZE + room_data], self.source),
                      self._irecv(self._tail, self.source)]

    def _post_sends(self, slot: int, data: torch.Tensor, header: Header, skeleton: bytes) -> None:
        raw = self._encoded(skeleton)
        room_data, room_json = self._room_out
        fits = header.data_len <= room_data and len(raw) <= room_json
        body = data[HEADER_SIZE:HEADER_SIZE + header.data_len] if fits else _EMPTY
        d = header.digest.ljust(32, b"\0")[:32]
        meta = [buddy.MAGIC, header.step, self.generation, self.world_size, self.rank, body.numel(),
                len(raw) if fits else 0, header.data_len, len(raw),
                *(int.from_bytes(d[i:i + 8], "little", signed=True) for i in range(0, 32, 8))]
        tail = bytearray(room_json + _META_BYTES)
        if fits:
            tail[:len(raw)] = raw
        tail[room_json:] = struct.pack(f"<{buddy.META_FIELDS}q", *meta)
        text = torch.frombuffer(tail, dtype=torch.uint8)
        self._sending = slot
        self._keep = [body, text]
        self._sends = [self._isend(body, self.holder), self._isend(text, self.holder)]
        self._room_out = (buddy.room(header.data_len), buddy.room(len(raw)))

    def _encoded(self, skeleton: bytes) -> bytes:
        """The skeleton as JSON: the last one's again when the pickle is the same, else
        encoded again where its entries changed (``peer.SkeletonEncoder``)."""
        if self._skeleton is None or self._skeleton[0] != skeleton:
            self._skeleton = (skeleton, self._encoder.encode(pickle.loads(skeleton)))  # our own bytes
        return self._skeleton[1]

    def _land(self) -> None:
        """The announcement arrived, so did everything before it: check, publish, resize."""
        t0 = time.perf_counter()
        works, self._recv = self._recv, []
        values = [0] * buddy.META_FIELDS
        try:
            for w in works:
                w.wait()  # complete (the announcement is the pair's last message): returns at once
            values = self._meta.tolist()
            problem = buddy.acceptable(values, world_size=self.world_size, source=self.source, limit=self._limit,
                                       room=self._room_in)
            if problem:
                self._break(problem, values[1])
                return
            step, generation, world, rank, data_len, json_len, need_data, need_json = values[1:9]
            self._room_in = (buddy.room(need_data), buddy.room(need_json))
            if (data_len, json_len) == (need_data, need_json):  # a whole copy, not a sizing one
                self._publish(step, generation, world, rank, data_len, json_len, values[9:13])
        except Exception as e:  # noqa: BLE001 - the slot stays unpublished; copies stop
            self._break(f"{e!r:.200}", values[1])
        finally:
            now = time.perf_counter()
            self.cost_s.append(self._cost + now - t0)
            self.wall_s.append(now - self._t0)

    def _publish(self, step: int, generation: int, world: int, rank: int, data_len: int, json_len: int,
                 digest_words: list[int]) -> None:
        target = self._target
        assert target is not None
        data = self.regions[target].data()
        data[HEADER_SIZE + data_len:HEADER_SIZE + data_len + json_len].copy_(self._tail[:json_len])
        digest = b"".join(v.to_bytes(8, "little", signed=True) for v in digest_words)
        self.regions[target].publish(Header(True, step, world, rank, data_len, json_len, digest,
                                            replicated=False, generation=generation))
        self._last = target
        self.announce = self.announce or self.held is None
        self.held = (step, data_len + json_len)

    def _break(self, problem: str, step: int) -> None:
        self.broken = True
        if self._recv:  # posted, never to be waited on: kept (``stop``)
            _ABANDONED.append((self._recv, self._tail))
        self._recv = []
        self._warn(f"rank {self.rank}: no buddy copy of rank {self.source} at step {step} ({problem}); "
                   "copies stop for this generation")

    # ----- the end ---------------------------------------------------------------------------
    def close(self, timeout: float) -> None:
        """At a normal end (every rank there, having started the same copies): let this rank's
        receive land and its sends complete, up to ``timeout`` in all."""
        deadline = time.monotonic() + timeout
        while self.moving() and time.monotonic() < deadline:
            time.sleep(0.002)  # the announcement's arrival has no wake-up to wait on
        if self._sends and not self.broken:
            # Its holder may have refused the copy (then the sends never complete): wait apart.
            waiter = threading.Thread(target=_wait_all, args=(self._sends,), name="eh-buddy-close", daemon=True)
            waiter.start()
            waiter.join(max(0.0, deadline - time.monotonic()))
        self.stop()

    def stop(self) -> None:
        """Leave the works in flight (a receive not landed stays unpublished). They stay
        referenced until the process ends: gloo keeps a raw pointer to each posted buffer, and
        a work let go would let its tensor (and the slot's mapping under it) be freed while a
        late message could still be written there."""
        if self._recv or self._sends:
            _ABANDONED.append((self._recv, self._sends, self._keep, self._tail))
        self._recv, self._sends, self._keep, self._sending = [], [], [], None


def _wait_all(works: list[Any]) -> None:
    for w in works:
        with contextlib.suppress(Exception):  # a holder gone at the end: nothing to do
            w.wait()
