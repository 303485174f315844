"""The checkpoint writer process: turns byte recipes into durable files, off training's CPU.

Started by ``offload.WriterProcess`` as ``python -I -S writer_child.py PARENT_PID SOCK_FD
CTL_FD`` (its parent sets its scheduling class); it imports only the standard library (no torch: it starts in tens of
milliseconds). The parent serialises each item itself (``torch.save`` into a recorder, see
``offload``), so what arrives here is, per file, a list of pieces: literal ``bytes`` (zip
headers, pickles, small payloads) or ``(segment, offset, length)`` ranges of the shared
staging memory (``arena``) holding the tensors' bytes. This process checksums them (CRC32)
and writes with ``O_DIRECT`` where the filesystem allows it: no page-cache copy and no
deferred writeback in a kernel thread, so nearly all of the write's CPU time is spent here,
in ``SCHED_IDLE``. A range whose place in memory and in the file agree modulo ``ALIGN`` (the
arena places buffers so, from the second save on) is written from the shared memory itself;
small pieces, and the unaligned ends of ranges, go through an aligned buffer (a copy that
costs training more than the write: measured, see ``arena``). The file is cut to its exact
size and fsynced (when asked): exactly the bytes of its recipe (DCP's items, each starting
at a multiple of 64: see ``offload.Recorder``).

Protocol (one request at a time, on a stream socket; ``send``/``recv`` below):

- child -> parent, once: ``("ready", pid)``.
- parent -> child: ``("write", req_id, files, sync, direct, new_segments)``, with the new
  segments' memfds attached (``[(segment id, size)]`` in the same order); ``files`` is
  ``[(path, filename, pieces)]``. Reply ``("done", req_id, {filename: {size, crc32}},
  {"copied": bytes that went through the aligned buffer, "in_place": bytes that did not})`` or
  ``("error", req_id, kind, errno, message)`` (kind ``stopped`` or ``oserror``).
- EOF on the socket: exit. The parent's death also kills this process (``PR_SET_PDEATHSIG``,
  plus a check that the parent is still the one that started it).

The control page (``CTL_FD``, shared memory) carries what must not wait for a message:
bytes written so far (progress, ``PROGRESS``) and the request id the parent wants stopped
(``STOP``: the next chunk raises and the file is left incomplete).

Limits: one thread; a write stuck in the kernel (hung NFS) cannot be stopped here either.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import signal
import socket
import struct
import sys
import zlib

PROGRESS, STOP = 0, 8
CTL_SIZE = 4096
ALIGN = 4096
CHUNK = 8 << 20
MAX_FDS = 253
_HEADER = struct.Struct("!Q")


def send(sock: socket.socket, obj: object, fds: list[int] = ()) -> None:
    """One message: an 8-byte length (carrying ``fds``), then the pickle."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    header = _HEADER.pack(len(data))
    if fds:
        socket.send_fds(sock, [header], list(fds))
        sock.sendall(data)
    else:
        sock.sendall(header + data)


def recv(sock: socket.socket) -> tuple[object, list[int]]:
    """The next message and the fds sent with it; ``EOFError`` when the peer closed."""
    head, fds, _, _ = socket.recv_fds(sock, _HEADER.size, MAX_FDS)
    while 0 < len(head) < _HEADER.size:
        more = sock.recv(_HEADER.size - len(head))
        if not more:
            break
        head += more
    if len(head) < _HEADER.size:
        for fd in fds:
            os.close(fd)
        raise EOFError("the peer closed the connection")
    (size,) = _HEADER.unpack(head)
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        n = sock.recv_into(view[got:])
        if not n:
            raise EOFError("the peer closed the connection mid-message")
        got += n
    return pickle.loads(buf), fds


def u64(ctl: mmap.mmap, at: int) -> int:
    return struct.unpack_from("=Q", ctl, at)[0]


def set_u64(ctl: mmap.mmap, at: int, value: int) -> None:
    struct.pack_into("=Q", ctl, at, value)


class Stopped(OSError):
    """The parent asked to stop this request: the file is left incomplete."""


class AlignedFile:
    """Append-only file written through an aligned buffer; ``O_DIRECT`` when possible.

    ``write`` copies into the buffer and writes whole chunks, or writes ``data`` where it
    lies when told its address modulo ``ALIGN`` (``phase``) and that matches its place in the
    file; ``close`` writes the tail padded to ``ALIGN``, cuts the file to its real size and
    fsyncs (if ``sync``). Invariant with ``O_DIRECT``: the buffer starts at an aligned offset.
    """

    def __init__(self, path: str, direct: bool, chunk: int = CHUNK) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        self.direct = direct and hasattr(os, "O_DIRECT")
        try:
            self.fd = os.open(path, flags | (os.O_DIRECT if self.direct else 0), 0o644)
        except OSError as e:
            if not self.direct or e.errno != 22:  # EINVAL: this filesystem has no O_DIRECT
                raise
            self.direct = False
            self.fd = os.open(path, flags, 0o644)
        self.buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
        self.fill = self.size = 0
        self.crc = 0
        self.in_place = 0  # bytes written from where they lay, not through ``buf``

    def write(self, data: memoryview, phase: int | None = None) -> int:
        """Append ``data``; ``phase``: its address modulo ``ALIGN`` if it may be written from
        where it lies (shared memory that stays put until the reply), else None."""
        n = len(data)
        self.crc = zlib.crc32(data, self.crc)
        if phase is not None:
            head = (-self.size) % ALIGN if self.direct else 0
            middle = (n - head) // ALIGN * ALIGN if self.direct else n
            if middle >= ALIGN and (not self.direct or phase == self.size % ALIGN):
                self._copy(data[:head])
                if self.fill:
                    self._flush(self.fill)  # ends aligned: the head completed its last block
                self._write_all(data[head:head + middle])
                self.in_place += middle
                self._copy(data[head + middle:])
                self.size += n
                return n
        self._copy(data)
        self.size += n
        return n

    def _copy(self, data: memoryview) -> None:
        """Into the buffer, writing it out each time it is full."""
        n = len(data)
        done = 0
        while done < n:
            take = min(n - done, len(self.buf) - self.fill)
            self.buf[self.fill:self.fill + take] = data[done:done + take]
            self.fill += take
            done += take
            if self.fill == len(self.buf):
                self._flush(self.fill)

    def _flush(self, length: int) -> None:
        view = memoryview(self.buf)[:length]
        try:
            self._write_all(view)
        finally:
            view.release()
        self.fill = 0

    def _write_all(self, view: memoryview) -> None:
        written = 0
        try:
            while written < len(view):
                written += os.write(self.fd, view[written:])
        except OSError as e:
            if not self.direct or e.errno != 22:
                raise
            self._buffered()  # the filesystem refused O_DIRECT writes after all
            while written < len(view):
                written += os.write(self.fd, view[written:])

    def _buffered(self) -> None:
        import fcntl

        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        self.direct = False

    def close(self, sync: bool) -> None:
        if self.fill:
            tail = (self.fill + ALIGN - 1) // ALIGN * ALIGN if self.direct else self.fill
            self.buf[self.fill:tail] = bytes(tail - self.fill)
            self._flush(tail)
            if tail != self.fill:
                os.ftruncate(self.fd, self.size)
        if sync:
            os.fsync(self.fd)
        self.abandon()

    def abandon(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.buf.close()


def write_file(path: str, pieces: list, segments: dict, ctl: mmap.mmap, req_id: int, sync: bool,
               direct: bool) -> tuple[dict, int]:
    """Write one file from its pieces; ``{size, crc32}`` of what was written, and how many
    of its bytes were written in place."""
    out = AlignedFile(path, direct)
    try:
        for piece in pieces:
            shared = not isinstance(piece, (bytes, bytearray))
            data = memoryview(segments[piece[0]])[piece[1]:piece[1] + piece[2]] if shared else memoryview(piece)
            for at in range(0, len(data), CHUNK):
                if u64(ctl, STOP) == req_id:
                    raise Stopped(125, "checkpoint write stopped: the save was abandoned")
                part = data[at:at + CHUNK]
                out.write(part, (piece[1] + at) % ALIGN if shared else None)  # mappings start page-aligned
                set_u64(ctl, PROGRESS, u64(ctl, PROGRESS) + len(part))
        out.close(sync)
    except BaseException:
        out.abandon()
        raise
    return {"size": out.size, "crc32": f"{out.crc:08x}"}, out.in_place


def serve(sock: socket.socket, ctl: mmap.mmap) -> None:
    segments: dict[int, mmap.mmap] = {}
    send(sock, ("ready", os.getpid()))
    while True:
        try:
            msg, fds = recv(sock)
        except EOFError:
            return
        _, req_id, files, sync, direct, new = msg
        for (seg, size), fd in zip(new, fds, strict=True):
            segments[seg] = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            os.close(fd)
        try:
            record, in_place = {}, 0
            for path, name, pieces in files:
                record[name], n = write_file(path, pieces, segments, ctl, req_id, sync, direct)
                in_place += n
            size = sum(r["size"] for r in record.values())
            reply = ("done", req_id, record, {"copied": size - in_place, "in_place": in_place})
        except Stopped as e:
            reply = ("error", req_id, "stopped", e.errno, str(e))
        except OSError as e:
            reply = ("error", req_id, "oserror", e.errno or 0, f"{e.strerror or e} ({e.filename or ''})")
        send(sock, reply)


def _die_with_parent(parent: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(0)


def main(argv: list[str]) -> int:
    parent, sock_fd, ctl_fd = int(argv[1]), int(argv[2]), int(argv[3])
    _die_with_parent(parent)
    # The worker's signals are not ours: a drain (SIGTERM) waits for the write to finish.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ctl = mmap.mmap(ctl_fd, CTL_SIZE)
    # BrokenPipe/ConnectionReset: the parent closed first, nothing left to answer.
    with socket.socket(fileno=sock_fd) as sock, contextlib.suppress(BrokenPipeError, ConnectionResetError):
        serve(sock, ctl)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
