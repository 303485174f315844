"""Asynchronous saves written by a separate, low-priority process instead of a thread.

An in-process writer thread competes with training for the GIL and the CPU; a separate
process in ``SCHED_IDLE`` only for the CPU, and only when training leaves a core idle.
The split, per save (``route``):

1. In the manager's write thread, DCP plans as usual (cached plans, its collectives), and
   its own per-file loop runs against a *recording* filesystem: every ``torch.save`` of an
   item lands in a ``Recorder``, which keeps the small writes (headers, pickles) as bytes
   and the big ones, the tensors' storage, as ranges of the staging ``arena`` (torch hands
   the stream a view of the storage itself, so nothing is copied). DCP computes the
   ``WriteResult``s (offsets, lengths) from the recorder's positions, exactly as it would.
2. The recipes go to the writer process (``writer_child``), which checksums and writes the
   bytes (``O_DIRECT`` where possible, from the arena itself once its buffers are placed to
   match the file: ``arena``) and fsyncs; the write thread waits for
   its reply, feeding its byte counter into the save's ``WriteWatch`` (progress) and
   passing a ``stop()`` on (the next chunk fails). The files hold the same items as the
   thread path's (each starting at a multiple of 64: ``Recorder``), with their size/CRC32
   record; the commit is unchanged.

Where it applies (``choose``): asynchronous saves, local storage with torch's plain
filesystem, CPU tensors staged in the arena, a writer process that said it is ready.
Everything else (blocking saves, which training waits for anyway; fsspec/S3, whose streams
are not files; CUDA jobs, whose staging is pinned memory; a writer still starting or
restarting) writes in the thread as before.

The process (``WriterProcess``) is started when the manager is (stdlib only: ready in tens of
milliseconds), by a thread that lives until ``close`` (``PR_SET_PDEATHSIG`` fires when the
thread that started a process ends). It dies with the worker (parent-death signal, and EOF
on its socket) and is never waited on without a bound. One that died is replaced at the
next save, which itself writes in the thread.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import errno
import io
import mmap
import os
import queue
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from elastic_harness.checkpoint import writer_child as proto
from elastic_harness.checkpoint.arena import PHASE_GRAIN, Arena
from elastic_harness.checkpoint.streams import WriteStopped, WriteWatch, write_watch

PROCESS, THREAD = "process", "thread"
BIG = 4096  # writes at least this long are looked up in the arena instead of copied
POLL_S = 0.05  # waiting for a start, with nothing else to do
REPLY_POLL_S = 1.0  # progress and stop checks while a write runs (see progress.BACKGROUND_POLL_S)
CLOSE_S = 5.0


def choose(asynchronous: bool, plain_local_fs: bool, on_cuda: bool, ready: bool) -> str:
    """Pure: does this save's write go to the writer process or stay in the thread?"""
    return PROCESS if asynchronous and plain_local_fs and not on_cuda and ready else THREAD


def available(url_storage: bool, cuda: bool) -> bool:
    """Pure-ish: may a manager start a writer process at all (Linux memfd, local storage, CPU)?"""
    return hasattr(os, "memfd_create") and hasattr(socket, "send_fds") and not url_storage and not cuda


def routed(writer: Any) -> bool:
    """Did ``route`` send this writer's shards to a writer process?"""
    return bool(getattr(writer, "eh_routed", False))


def plain_local_fs(writer: Any) -> bool:
    """Is ``writer`` a watched DCP ``FileSystemWriter`` on torch's own local filesystem?"""
    from torch.distributed.checkpoint.filesystem import FileSystem

    watched = getattr(writer, "fs", None)
    return write_watch(writer) is not None and type(getattr(watched, "_inner", None)) is FileSystem


class Recorder(io.RawIOBase):
    """A write-only stream that records pieces: ``bytes`` or ``(segment, offset, length)``.

    Items start at multiples of ``PHASE_GRAIN`` (zero bytes between them, which no item's
    ``(offset, length)`` covers), so that the 64-byte alignment ``torch.save`` gives the
    tensor bytes inside its archive holds in the file too and the arena can place buffers to
    match (a valid DCP file; DCP's own writer packs items back to back). DCP's per-item
    pattern is ``tell`` (offset), writes, ``flush`` (its wrapper's close), ``tell`` (length):
    a ``tell`` that follows that end-of-item ``tell`` with no write between starts an item.
    """

    def __init__(self, arena: Arena) -> None:
        self.arena, self.pieces, self.pos = arena, [], 0
        self._phase = ""  # "" | "wrote" | "flushed" | "ended": where DCP is in an item

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        if self._phase == "wrote":
            self._phase = "flushed"

    def tell(self) -> int:
        if self._phase == "flushed":
            self._phase = "ended"
        elif self._phase == "ended" and self.pos % PHASE_GRAIN:  # the next item starts here
            self._append(bytes(PHASE_GRAIN - self.pos % PHASE_GRAIN))
            self._phase = ""
        return self.pos

    def _append(self, view: Any) -> None:
        if self.pieces and isinstance(self.pieces[-1], bytearray):
            self.pieces[-1] += view
        else:
            self.pieces.append(bytearray(view))
        self.pos += len(view)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        self._phase = "wrote"
        address = _address(view) if n >= BIG else 0
        where = self.arena.locate(address, n) if n >= BIG else None
        if where is None:
            self._append(view)
            return n
        self.pieces.append((*where, n))
        self.arena.misplaced(address, self.pos)  # where it should lie for a direct write
        self.pos += n
        return n


def _address(view: memoryview) -> int:
    import numpy as np

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class WriterProcess:
    """One writer process for one manager; ``write`` sends a save's recipes and waits."""

    def __init__(self, arena: Arena, threads: Any) -> None:
        """``threads``: the manager's ``BackgroundThreads``; each process is ``adopt``-ed (its
        scheduling class: ``SCHED_IDLE`` unless someone waits) and ``disown``-ed before reaping."""
        self.arena, self._threads = arena, threads
        self._ctl_fd = os.memfd_create("eh-ckpt-writer-ctl", os.MFD_CLOEXEC)
        os.ftruncate(self._ctl_fd, proto.CTL_SIZE)
        self.ctl = mmap.mmap(self._ctl_fd, proto.CTL_SIZE)
        self._spawns: queue.Queue = queue.Queue()
        self._owner = threading.Thread(target=self._own, name="ckpt-writer-owner", daemon=True)
        self._owner.start()
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self._ready = self._closed = False
        self._req = 0
        self.last_write: dict[str, int] = {}  # the last request's bytes copied / written in place
        try:
            self.start()
        except BaseException:
            self.close()
            raise

    # ----- lifetime (the owner thread) -----
    def _own(self) -> None:
        """Start processes on request; the thread lives until ``close`` (parent-death signal)."""
        while (job := self._spawns.get()) is not None:
            fut, mine = job
            try:
                fut.set_result(self._spawn(mine))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)

    def _spawn(self, mine: socket.socket) -> subprocess.Popen:
        cmd = [sys.executable, "-I", "-S", proto.__file__, str(os.getpid()), str(mine.fileno()),
               str(self._ctl_fd)]
        return subprocess.Popen(cmd, pass_fds=(mine.fileno(), self._ctl_fd), stdin=subprocess.DEVNULL)

    def start(self) -> None:
        """Start a new process (not waiting for it to be ready)."""
        ours, mine = socket.socketpair()
        fut: cf.Future = cf.Future()
        self._spawns.put((fut, mine))
        try:
            self.proc = fut.result(timeout=30)
        except BaseException:
            ours.close()
            raise
        finally:
            mine.close()
        self.sock, self._ready = ours, False
        self.arena.resend_all()
        self._threads.adopt(self.proc.pid)

    def ready(self) -> bool:
        """Has the process said it is ready? Restarts one that died. Never blocks."""
        if self._closed:
            return False
        if self.proc is None or self.proc.poll() is not None:
            self._drop()
            with contextlib.suppress(OSError):  # out of processes or fds: the thread writes
                self.start()
            return False
        if not self._ready and select.select([self.sock], [], [], 0)[0]:
            try:
                msg, _ = proto.recv(self.sock)
                self._ready = msg[0] == "ready"
            except (EOFError, OSError):
                self._drop()
        return self._ready

    def wait_ready(self, timeout: float) -> bool:
        """Block until ``ready()`` (at most ``timeout`` s); for callers with nothing else to do."""
        deadline = time.monotonic() + timeout
        while not self.ready():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self.sock is not None:
                select.select([self.sock], [], [], min(left, POLL_S))
            else:  # it could not be started: try again shortly
                time.sleep(min(left, POLL_S))
        return True

    def _drop(self) -> None:
        """Forget a process that died or misbehaved (reaped, socket closed)."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.proc is not None:
            self._threads.disown(self.proc.pid)
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(timeout=CLOSE_S)
        self.proc, self._ready = None, False

    def close(self) -> None:
        """End the process (EOF, then a bounded wait, then SIGKILL) and the owner thread."""
        self._closed = True
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.proc is not None:
            self._threads.disown(self.proc.pid)
            try:
                self.proc.wait(timeout=CLOSE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        self._spawns.put(None)
        self._owner.join(timeout=CLOSE_S)
        self.ctl.close()
        os.close(self._ctl_fd)

    # ----- one save -----
    def write(self, files: list[tuple[str, str, list]], sync: bool, watch: WriteWatch, direct: bool = True) -> dict:
        """Write ``files`` (``[(path, filename, pieces)]``); the ``{filename: {size, crc32}}``
        record. ``direct``: ``O_DIRECT`` where the filesystem allows. Raises ``WriteStopped`` after ``watch.stop()``, ``OSError`` for the disk's
        errors (errno kept) and when the process died."""
        self._req += 1
        req = self._req
        new = self.arena.unsent()
        watch._enter()  # an open stream until the process answers or dies: ``quiet`` waits
        seen = proto.u64(self.ctl, proto.PROGRESS)
        try:
            proto.send(self.sock, ("write", req, files, sync, direct, [(s.id, s.size) for s in new]),
                       [s.fd for s in new])
            reply = self._await(req, watch, seen)
        except (EOFError, OSError) as e:
            if isinstance(e, WriteStopped):
                raise
            self._drop()
            raise OSError(errno.EPIPE, f"the checkpoint writer process died mid-save ({e!r:.200})") from None
        finally:
            watch._leave()
        if reply[0] == "done":
            self.last_write = reply[3]
            return reply[2]
        _, _, kind, code, message = reply
        if kind == "stopped":
            raise WriteStopped(message)
        raise OSError(code, message)

    def _await(self, req: int, watch: WriteWatch, seen: int) -> tuple:
        """The reply to ``req``; meanwhile bytes since ``seen`` go to ``watch``, and its stop on."""
        while not select.select([self.sock], [], [], REPLY_POLL_S)[0]:
            now = proto.u64(self.ctl, proto.PROGRESS)
            if now != seen:
                watch.counter.add(now - seen)
                seen = now
            if watch.stopped:
                proto.set_u64(self.ctl, proto.STOP, req)
        msg, _ = proto.recv(self.sock)
        watch.counter.add(proto.u64(self.ctl, proto.PROGRESS) - seen)
        return msg


def route(writer: Any, proc: WriterProcess) -> Any:
    """Make ``writer`` (a watched local ``FileSystemWriter``) write its shards through ``proc``.

    DCP's own ``write_data`` runs as usual, with the writer's filesystem a recording one for
    that call (``_RecordingFS``: every shard file becomes a recipe, nothing reaches the disk)
    and ``sync_files`` off (a recorder has nothing to sync: the process syncs); the recipes
    then go to ``proc``. The ``.metadata`` that rank 0 writes in ``finish`` still goes
    through the watched filesystem. Only public names of the writer are used (``write_data``,
    ``fs``, ``sync_files``): no torch internals (issue 35).
    """
    from torch.futures import Future

    watch = write_watch(writer)
    dcp_write_data = type(writer).write_data  # torch's, not the watch's wrapper

    def write_data(plan: Any, planner: Any) -> Any:
        try:
            recipes: list[tuple[str, str, list]] = []
            watched, sync = writer.fs, writer.sync_files
            writer.fs, writer.sync_files = _RecordingFS(watched, recipes, proc.arena), False
            try:
                done = dcp_write_data(writer, plan, planner).wait()
            finally:
                writer.fs, writer.sync_files = watched, sync
            watch.record.update(proc.write(recipes, sync, watch))
            fut: Future = Future()  # DCP waits on torch's kind
            fut.set_result(done)
            return fut
        finally:
            watch.done = True  # as the watch's own wrapper does, once the bytes are written

    writer.write_data = write_data
    writer.eh_routed = True  # ours, for ``routed``
    return writer


class _RecordingFS:
    """A DCP filesystem whose created streams are ``Recorder``s: each file written becomes a
    recipe ``(path, filename, pieces)``; everything else is the wrapped filesystem's."""

    def __init__(self, inner: Any, recipes: list, arena: Arena) -> None:
        self._inner, self._recipes, self._arena = inner, recipes, arena

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Recorder]:
        rec = Recorder(self._arena)
        yield rec
        name = os.path.basename(os.fspath(path))
        self._recipes.append((os.fspath(path), name, [bytes(p) if isinstance(p, bytearray) else p
                                                      for p in rec.pieces]))
