"""The buddy copies in flight (``buddy``): send this rank's snapshot to its holder, receive
its source's copy into a buddy slot, without the step loop waiting on either.

``start`` hands the exchange to the link's copy thread (a daemon, started with the first
exchange and kept: ``Thread.start`` holds its caller until the new thread lets go of the GIL,
which on a loaded 2-core machine put 5-14 ms into every snapshot that sent a copy), which
posts the sends (``isend``: gloo moves the bytes from its own thread, straight out of this
rank's published slot), waits for them (a gloo send's work says it completed only once
waited on) and receives the source's copy:
an announcement (``buddy.META_FIELDS`` int64), then the tensor bytes straight into the buddy
slot not holding the newest copy (``begin`` unpublished it first) and the skeleton as JSON
(``peer.encode_skeleton``: nothing received is ever unpickled), both posted before waiting
on either. Every call that lets go of the GIL is a handoff with the training thread on a
busy machine, so an exchange makes as few as it can (``bench buddy`` times one). The slot
is published only after its last byte arrived, so a copy whose sender died mid-way stays
unpublished and is never offered. ``busy`` says whether anything is still moving or the
link broke (the ranks agree on it in the step's all-reduce before starting the next
exchange, ``buddy.due``), ``moving`` whether an exchange is in flight (none on any rank:
the last copy is complete everywhere, ``MemoryTier.save``'s ``settled``), ``sending(slot)``
whether an own slot is still being read (never written over then).
"""

from __future__ import annotations

import pickle
import queue
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from elastic_harness.memtier import buddy, peer
from elastic_harness.memtier.region import Region
from elastic_harness.memtier.slots import HEADER_SIZE, Header, next_slot


class BuddyLink:
    def __init__(self, regions: list[Region], *, rank: int, world_size: int, local_size: int, generation: int,
                 isend: Callable[[torch.Tensor, int], Any], irecv: Callable[[torch.Tensor, int], Any],
                 warn: Callable[[str], None]) -> None:
        self.regions, self.rank, self.world_size, self.generation = regions, rank, world_size, generation
        self.holder = buddy.holder_of(rank, world_size, local_size)
        self.source = buddy.source_of(rank, world_size, local_size)
        self._isend, self._irecv, self._warn = isend, irecv, warn
        self._works: list[Any] = []
        self._keep: list[torch.Tensor] = []  # what the sends read, alive until they complete
        self._sending: int | None = None  # the own slot being sent
        self._thread: threading.Thread | None = None  # the copy thread, once started
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # exchanges for it; None: stop
        self._done = threading.Event()  # the exchange handed over last has ended
        self._moving = False  # an exchange was handed over and not collected yet
        self._result: tuple[int, int, str | None] | None = None  # (step, bytes, problem) of the last receive
        self._last: int | None = None  # the buddy slot holding the newest copy
        self.held: tuple[int, int] | None = None  # (step, bytes) of the newest copy held
        self.announce = False  # the generation's first copy arrived (reported once, then cleared)
        self.broken = False
        self.cpu_s: deque[float] = deque(maxlen=16)  # the copy thread's CPU seconds, per exchange
        self.wall_s: deque[float] = deque(maxlen=16)  # and its wall seconds (a copy's latency)
        self.last_step = 0  # the step of the last exchange started

    def busy(self) -> bool:
        """Is a copy still moving, to or from this rank? (Collects what finished.)"""
        if self._moving and self._done.is_set():
            self._moving = False
            self._works, self._keep, self._sending = [], [], None
            step, size, problem = self._result or (0, 0, "the receiver stopped")
            if problem:
                self.broken = True
                self._warn(f"rank {self.rank}: no buddy copy of rank {self.source} at step {step} ({problem}); "
                           "copies stop for this generation")
            else:
                self.announce = self.announce or self.held is None
                self.held = (step, size)
        return self._moving or self.broken

    def moving(self) -> bool:
        """Is an exchange still in flight here? (A broken link is busy but not moving: its
        last exchange ended.)"""
        self.busy()
        return self._moving

    def copy_cpu_s(self) -> float:
        """The median CPU seconds an exchange took this rank's copy thread (0 before one)."""
        return statistics.median(self.cpu_s) if self.cpu_s else 0.0

    def sending(self, slot: int) -> bool:
        """Is own ``slot`` still being read by a send?"""
        self.busy()
        return self._sending == slot

    def start(self, slot: int, data: torch.Tensor, header: Header, skeleton: bytes, limit: int) -> None:
        """Send the own ``slot`` (its bytes ``data``, published with ``header``; ``skeleton``
        its pickled skeleton, our own bytes, turned into JSON in the thread: off the step's
        path) to the holder; receive the source's copy, up to ``limit`` bytes."""
        self._sending = slot
        self._result = None
        self._works, self._keep = [], []
        self.last_step = header.step
        self._done.clear()
        self._moving = True
        self._jobs.put((data, header, skeleton, limit))
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="eh-buddy", daemon=True)
            self._thread.start()  # once: a thread that starts takes the GIL from its caller

    def _serve(self) -> None:
        """The copy thread: one exchange after another, until ``stop``."""
        while (job := self._jobs.get()) is not None:
            try:
                self._move(*job)
            finally:
                self._done.set()

    def _send(self, data: torch.Tensor, header: Header, skeleton: bytes) -> None:
        raw = peer.encode_skeleton(pickle.loads(skeleton))  # our own bytes (``start``)
        d = header.digest.ljust(32, b"\0")[:32]
        meta = torch.tensor([header.step, self.generation, self.world_size, self.rank, header.data_len,
                             len(raw), *(int.from_bytes(d[i:i + 8], "little", signed=True)
                                         for i in range(0, 32, 8))], dtype=torch.int64)
        body = data[HEADER_SIZE:HEADER_SIZE + header.data_len]
        self._keep = [meta, body, torch.frombuffer(bytearray(raw), dtype=torch.uint8)]
        self._works = [self._isend(meta, self.holder)]
        if header.data_len:
            self._works.append(self._isend(body, self.holder))
        self._works.append(self._isend(self._keep[2], self.holder))

    def _move(self, data: torch.Tensor, header: Header, skeleton: bytes, limit: int) -> None:
        """The daemon thread: post the sends, receive one copy, then wait for the sends."""
        t0, w0 = time.thread_time(), time.perf_counter()
        try:
            self._transfer(data, header, skeleton, limit)
        finally:
            self.cpu_s.append(time.thread_time() - t0)
            self.wall_s.append(time.perf_counter() - w0)

    def _transfer(self, data: torch.Tensor, header: Header, skeleton: bytes, limit: int) -> None:
        try:
            self._send(data, header, skeleton)
        except Exception as e:  # noqa: BLE001 - the holder then waits in vain: copies stop (``busy``)
            self._result = (header.step, 0, f"sending: {e!r:.200}")
            return
        self._receive(limit)
        for w in self._works:
            try:
                w.wait()
            except Exception as e:  # noqa: BLE001 - its holder is gone: that generation ends anyway
                if self._result is not None and self._result[2] is None:
                    self._result = (self._result[0], self._result[1], f"sending to rank {self.holder}: {e!r:.200}")

    def _receive(self, limit: int) -> None:
        """One copy from the source into a buddy slot."""
        meta = torch.zeros(buddy.META_FIELDS, dtype=torch.int64)
        step = 0
        try:
            self._irecv(meta, self.source).wait()
            values = meta.tolist()
            step = values[0]
            problem = buddy.acceptable(values, world_size=self.world_size, source=self.source, limit=limit)
            if problem:
                self._result = (step, 0, problem)
                return
            _, generation, world, rank, data_len, json_len = values[:6]
            digest = b"".join(v.to_bytes(8, "little", signed=True) for v in values[6:10])
            target = next_slot(self._last, len(self.regions))
            data = self.regions[target].begin(HEADER_SIZE + data_len + json_len)  # unpublished first
            works = [self._irecv(data[HEADER_SIZE:HEADER_SIZE + data_len], self.source)] if data_len else []
            works.append(self._irecv(data[HEADER_SIZE + data_len:HEADER_SIZE + data_len + json_len], self.source))
            for w in works:  # the same order as the sender's messages: both posted, then waited on
                w.wait()
            self.regions[target].publish(Header(True, step, world, rank, data_len, json_len, digest,
                                                replicated=False, generation=generation))
            self._last = target
            self._result = (step, data_len + json_len, None)
        except Exception as e:  # noqa: BLE001 - reported by ``busy``; the slot stays unpublished
            self._result = (step, 0, f"{e!r:.200}")

    def close(self, timeout: float) -> None:
        """Let the copies in flight finish (every rank started the same ones), up to ``timeout``."""
        if self._moving:
            self._done.wait(timeout)
        self.busy()
        self.stop()

    def stop(self) -> None:
        """Let the copy thread end once its exchange in flight does (a daemon: one stuck on a
        dead peer is abandoned, as before)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread = None
