"""The buddy copies' byte streams (``conduit``): one TCP connection from each rank to the rank
that holds its copies and one from the rank whose copies it holds, authenticated both ways
under the job's key, then moved only by the training thread in calls that never block.

Why not gloo (the previous transport): a gloo message, even of 100 bytes, cost a 2-core step
~2 ms (its loop threads' wake-ups on both ends, a ready notice before every send), whatever
the bytes. On a stream of our own a copy is one message the kernel moves: ``push`` copies
what the socket's buffer takes, ``pull_into`` copies what arrived, and nothing else wakes up
(``bench buddy``). A call moves at most what the kernel's buffers hold, so it never blocks;
a large copy moves over several calls (the step loop calls them every step).

Setting up (``Conduit.connect``, collective over ``gather``, every rank at once): each rank
listens on this node's address (the one that routes to the job's store host:
``local_address``; loopback for a one-machine job), the ranks gather the addresses, then each
connects to its holder and accepts its source. Both ends prove they know the job's key
before a byte of a copy is read: the connecting end sends a nonce, the accepting end answers
``HMAC(key, nonce, who)`` and its own nonce, the connecting end answers that in turn
(``proof``). A connection that fails the proof is closed; the link then keeps no copies this
generation (storage and own snapshots still restore). Connections are read side by side
until one says it is the source (``_accept_source``): a stranger who connects and says
nothing does not hold the setup up. Nothing read is ever unpickled.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import secrets
import selectors
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

from elastic_harness import jobkey

NONCE = 16
_HELLO = struct.Struct("<4sqqq")  # b"EHBC", generation, connecting rank, accepting rank
_MAGIC = b"EHBC"
_CONTEXT = b"elastic-harness buddy copy link"
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)  # a closed peer is an error here, never a SIGPIPE
ADDRESS_INTS = 3  # an address as int64s: two halves of the IPv6(-mapped) address, the port
MAX_PENDING = 64  # accepted connections read side by side while waiting for the source's hello


class LinkError(ConnectionError):
    """A copy link could not be set up or broke (the peer closed, failed the proof)."""


def local_address(store_host: str) -> str:
    """The address of this node that routes to ``store_host`` (where the job's ranks meet,
    which every node reaches): loopback for a job on loopback. Nothing is sent (a UDP
    socket's connect only asks the routing table); loopback if even that fails. On the
    store's own node a host name that resolves to loopback here only (Debian's
    ``127.0.1.1 HOSTNAME``) gives loopback, as it gives gloo: set ``--local-addr``."""
    host = store_host.strip("[]") or "127.0.0.1"
    try:
        info = socket.getaddrinfo(host, 1, type=socket.SOCK_DGRAM)[0]
        with socket.socket(info[0], socket.SOCK_DGRAM) as s:
            s.connect(info[4])
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def encode_address(host: str, port: int) -> list[int]:
    """Pure: ``(host, port)`` as ``ADDRESS_INTS`` int64 (an IPv4 address IPv6-mapped; all 0: none)."""
    ip = ipaddress.ip_address(host)
    packed = (ipaddress.IPv6Address(f"::ffff:{ip}") if ip.version == 4 else ip).packed
    hi, lo = struct.unpack("<qq", packed)
    return [hi, lo, port]


def decode_address(values: list[int]) -> tuple[str, int] | None:
    """Pure: the inverse of ``encode_address``; None for all zeros (that rank keeps no link)."""
    if len(values) != ADDRESS_INTS or not any(values) or not 0 < values[2] < 65536:
        return None
    ip = ipaddress.IPv6Address(struct.pack("<qq", values[0], values[1]))
    return (str(ip.ipv4_mapped) if ip.ipv4_mapped else str(ip)), values[2]


def proof(key: bytes, nonce: bytes, generation: int, sender: int, holder: int, side: bytes) -> bytes:
    """Pure: what an end of the link from ``sender`` to ``holder`` answers to ``nonce``: bound
    to the generation, both ranks and the side answering, so no answer is valid elsewhere."""
    return jobkey.tag(key, nonce + struct.pack("<qqq", generation, sender, holder) + side, _CONTEXT)


@dataclass(frozen=True)
class LinkSettings:
    """The copies' link settings, the same on every rank: the generation whose copies it
    carries, the job's key its ends prove, the address this rank listens on, and the seconds
    the setup may take."""

    generation: int
    key: bytes
    host: str
    timeout: float


class Conduit:
    """A rank's two streams: ``out`` to its holder, ``inp`` from its source (non-blocking)."""

    def __init__(self, out: socket.socket, inp: socket.socket) -> None:
        self.out, self.inp = out, inp
        for s in (out, inp):
            s.setblocking(False)
            with contextlib.suppress(OSError):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._pending: list[memoryview] = []

    # ----- sending -------------------------------------------------------------------------
    def offer(self, pieces: list[memoryview]) -> None:
        """Queue ``pieces`` (read, not copied: each view keeps its buffer alive, which must
        stay unchanged until ``push`` says everything left)."""
        self._pending.extend(p.cast("B") for p in pieces if p.nbytes)

    def push(self) -> bool:
        """Send what the socket takes now; True when nothing is left. Raises ``LinkError``."""
        while self._pending:
            piece = self._pending[0]
            try:
                n = self.out.send(piece, _NOSIGNAL)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError as e:
                raise LinkError(f"the holder closed the link ({e.strerror or e})") from None
            if n < piece.nbytes:
                self._pending[0] = piece[n:]
                return False
            self._pending.pop(0)
        return True

    # ----- receiving -----------------------------------------------------------------------
    def pull_into(self, view: memoryview) -> int:
        """Read what has arrived, up to ``len(view)`` bytes, into ``view``; how many. Raises
        ``LinkError`` when the source closed the link."""
        got = 0
        while got < view.nbytes:
            try:
                n = self.inp.recv_into(view[got:])
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                raise LinkError(f"the source's link broke ({e.strerror or e})") from None
            if n == 0:
                raise LinkError("the source closed the link")
            got += n
        return got

    def close(self) -> None:
        for s in (self.out, self.inp):
            with contextlib.suppress(OSError):
                s.close()
        self._pending = []

    # ----- setting up ----------------------------------------------------------------------
    @classmethod
    def connect(cls, link: LinkSettings, *, rank: int, holder: int, source: int,
                gather: Callable[[list[int]], list[list[int]]], able: bool = True,
                warn: Callable[[str], None] = lambda message: None) -> Conduit | None:
        """Collective over ``gather`` (every rank calls it, ``able`` or not): the link of
        ``rank`` to ``holder`` and from ``source``, or None on every rank unless every rank
        was ``able`` (has buddy slots) and set its link up (a failure is ``warn``-ed where it
        happened; the ranks then agree in a last gather, so none waits on a copy that no one
        sends)."""
        generation, key, host, timeout = link.generation, link.key, link.host, link.timeout
        listening = None
        mine = [0] * ADDRESS_INTS
        if able:
            try:
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                listening = socket.create_server((host, 0), family=family, backlog=4)
                mine = encode_address(host, listening.getsockname()[1])
            except (OSError, ValueError) as e:
                warn(f"rank {rank}: cannot listen for buddy copies on {host} ({e})")
        conduit = None
        try:
            everyone = gather(mine)
            to, frm = decode_address(everyone[holder]), decode_address(everyone[source])
            if listening is not None and to is not None and frm is not None:
                conduit = _handshake(listening, to, rank=rank, holder=holder, source=source, generation=generation,
                                     key=key, deadline=time.monotonic() + timeout)
        except LinkError as e:
            warn(f"rank {rank}: {e}")
        finally:
            if listening is not None:
                listening.close()
        if all(ok for (ok,) in gather([int(conduit is not None)])):
            return conduit
        if conduit is not None:
            conduit.close()
        return None


def _handshake(listening: socket.socket, to: tuple[str, int], *, rank: int, holder: int, source: int,
               generation: int, key: bytes, deadline: float) -> Conduit:
    """Connect to the holder and accept the source, each end proving the key (module doc).
    In four stages, each waiting only on a stage the peers did earlier, so no ring deadlocks."""
    out = inp = None
    try:
        out = socket.create_connection(to, timeout=_left(deadline))
        mine = secrets.token_bytes(NONCE)
        out.sendall(_HELLO.pack(_MAGIC, generation, rank, holder) + mine)  # 1: hello to the holder
        inp, hello = _accept_source(listening, generation=generation, source=source, rank=rank,
                                    deadline=deadline)  # 2: the source's hello, answered
        inp.settimeout(_left(deadline))
        theirs = secrets.token_bytes(NONCE)
        inp.sendall(proof(key, hello[_HELLO.size:], generation, source, rank, b"holder") + theirs)
        out.settimeout(_left(deadline))
        answer = _read(out, jobkey.TAG_BYTES + NONCE)  # 3: the holder's proof, and ours to it
        expected = proof(key, mine, generation, rank, holder, b"holder")
        if not hmac.compare_digest(answer[:jobkey.TAG_BYTES], expected):
            raise LinkError(f"rank {holder} at {to[0]}:{to[1]} did not prove the job's key")
        out.sendall(proof(key, answer[jobkey.TAG_BYTES:], generation, rank, holder, b"sender"))
        expected = proof(key, theirs, generation, source, rank, b"sender")
        if not hmac.compare_digest(_read(inp, jobkey.TAG_BYTES), expected):
            raise LinkError(f"the connection claiming to be rank {source} did not prove the job's key")  # 4
        return Conduit(out, inp)
    except BaseException as e:
        for s in (out, inp):
            if s is not None:
                s.close()
        if isinstance(e, OSError) and not isinstance(e, LinkError):  # a timeout, a refused connect
            raise LinkError(f"setting up the copy link failed ({e})") from None
        raise


def _accept_source(listening: socket.socket, *, generation: int, source: int, rank: int,
                   deadline: float) -> tuple[socket.socket, bytes]:
    """The accepted connection whose hello names ``source`` connecting to ``rank`` in this
    generation, and that hello. Every connection is read as its bytes come, side by side
    (``selectors``), so one that connects and says nothing, or too little, holds no one up;
    a hello naming anyone else is dropped at once. At most ``MAX_PENDING`` connections wait
    (the oldest dropped for a newer one); the link's deadline bounds it all."""
    hellos = _Hellos(listening, (_MAGIC, generation, source, rank))
    try:
        while True:
            for event, _ in hellos.select(_left(deadline)):
                conn = event.fileobj
                if conn is listening:
                    hellos.accept()
                    continue
                hello = hellos.read(conn)
                if hello is not None:
                    return conn, hello
    finally:
        hellos.close()


class _Hellos:
    """The connections accepted on ``listening``, each read as its bytes come until it said
    a whole hello: the ``expected`` one's connection is handed over, any other dropped."""

    SIZE = _HELLO.size + NONCE

    def __init__(self, listening: socket.socket, expected: tuple) -> None:
        self.listening, self.expected = listening, expected
        self.pending: dict[socket.socket, bytearray] = {}
        self.sel = selectors.DefaultSelector()
        listening.setblocking(False)
        self.sel.register(listening, selectors.EVENT_READ)

    def select(self, timeout: float) -> list:
        return self.sel.select(timeout)

    def accept(self) -> None:
        """A new connection, if one is there (the oldest waiting dropped past ``MAX_PENDING``)."""
        with contextlib.suppress(BlockingIOError, InterruptedError):
            new, _ = self.listening.accept()
            new.setblocking(False)
            if len(self.pending) >= MAX_PENDING:
                self._drop(next(iter(self.pending)))
            self.pending[new] = bytearray()
            self.sel.register(new, selectors.EVENT_READ)

    def read(self, conn: socket.socket) -> bytes | None:
        """What ``conn`` sent now; its whole hello once it is the expected one (``conn`` then
        blocking, no longer watched), else None."""
        got = self.pending.get(conn)
        if got is None:  # dropped for a newer one in this same round
            return None
        try:
            chunk = conn.recv(self.SIZE - len(got))
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            chunk = b""
        if not chunk:  # closed before a whole hello
            self._drop(conn)
            return None
        got += chunk
        if len(got) < self.SIZE:
            return None
        if _HELLO.unpack(bytes(got[:_HELLO.size])) != self.expected:
            self._drop(conn)  # not our source (a stray connection): wait for the right one
            return None
        self.sel.unregister(conn)
        del self.pending[conn]
        conn.setblocking(True)
        return bytes(got)

    def _drop(self, conn: socket.socket) -> None:
        self.sel.unregister(conn)
        del self.pending[conn]
        conn.close()

    def close(self) -> None:
        for conn in self.pending:
            conn.close()
        self.sel.close()


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise LinkError("setting up the copy link timed out")
    return left


def _read(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise LinkError("the peer closed the link while setting up")
        buf += chunk
    return bytes(buf)


__all__ = ["Conduit", "LinkError", "local_address", "encode_address", "decode_address", "proof"]
