"""Rendezvous backends of our own (c10d, etcd-v2) with the state authenticated by the job's key.

torch's dynamic rendezvous pickles its state (``_BackendRendezvousStateHolder``) and hands
the bytes to a backend, which stores them base64-encoded under one key of the c10d store or
etcd; on every sync it reads them back and ``pickle.loads`` them. Anyone who can write that
key can make every agent run code (a forged pickle ran a shell command within
1 s; garbage ended the job). The backends here seal what they write and check what they read:

- ``set_state`` stores ``HMAC(key, run id, state) || state`` (``jobkey.seal``), where the
  state is torch's pickled state and, beside it, the rendezvous' own fields (``pack``:
  ``rendezvous.rules.Ours``, kept in ``StateSeal.beside``, never set on torch's object);
- every value read back goes through ``StateSeal.open`` before torch sees it: one that is
  not sealed with this job's key for this rendezvous id (a forgery, garbage, bytes that are
  not even UTF-8, another job's state, torch's "no state yet" marker once a state was seen)
  reads as the last authentic state this agent saw (a fresh, empty state before it saw
  any: ``torchcompat.rdzv.fresh_state``), with a logged line (rate-limited: ``LOG_EVERY_S``). The token stays the exact
  value read, so the agent's next write replaces it, and the job goes on (the
  token used to be the raw bytes torch then decoded as UTF-8, and non-UTF-8 bytes ended
  the agent).

Both backends are ours, written on torch's public backend interface (``RendezvousBackend``:
``name``, ``get_state``, ``set_state``), no torch class subclassed. The c10d one
(``SealedC10dBackend``): its reads never block on a deleted key and a deleted key is written
again (the agents blocked at the job's end for ``read_timeout`` each). The etcd-v2
one (``SealedEtcdBackend``): one key of etcd's v2 API, written with ``prevIndex``/``prevExist``
and a TTL of two hours, as torch's etcd-v2 backend does; etcd tells a missing key apart
itself. The seal does not depend on the store: etcd v3's backend (``rendezvous.etcd_v3``) uses
``StateSeal`` the same way. Each backend's ``name`` is the one ``rendezvous.handler``
registers the handler under in torch's handler registry (``harness-c10d``, ``harness-etcd-v2``).

The c10d store itself: ``create_c10d_backend`` is torch's ``create_backend`` for a TCP
store, except that the agent hosting the store binds the endpoint's host (``listen``), not
every interface: ``127.0.0.1`` for a local run, the address the job gave its nodes
elsewhere. A file store (``store_type=file``) is torch's ``FileStore`` at the endpoint's path.

Changes are pushed on a TCP store (``rendezvous.changes``). After a write that the handler marks
as worth announcing (``worth_announcing``, set by ``rendezvous.handler``: the round broken,
reopened, completed or closed, the first node waiting, the spares), the backend adds one to
a change count in the store (sealed too, and by compare-and-set: never the store's ``add``);
``wait_for_change`` blocks until the count passes the one this
thread saw at its last read or write. A joining agent's poll and a running agent's monitor
wait end there instead of at a fixed interval. The count carries no state: a woken agent
reads and opens the sealed state as before, so a forged count costs a read and nothing more
(and is rewritten at the next change).
A file store has no signal: ``wait_for_change`` answers None and the handler sleeps as torch
does.
"""

from __future__ import annotations

import binascii
import logging
import pickle
import time
from base64 import b64decode, b64encode
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch.distributed import FileStore, TCPStore
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from elastic_harness import jobkey
from elastic_harness.listen import listener
from elastic_harness.rendezvous.changes import Announcing, ChangeSignal
from elastic_harness.torchcompat import rdzv

log = logging.getLogger(__name__)


# torch's c10d backend's marker for "no state yet" (a store read blocks on a missing key, so
# the key is created holding this); the same bytes, so a store torch's backend set up reads alike.
ABSENT = b"Y2FuaW1hZGFt"

# Seconds between two log lines about refused values: the first is logged at once, then at
# most one line per window with how many more came (a writer in a loop does not flood the log).
LOG_EVERY_S = 30.0


def freshness(seq: int, state: bytes, seen: int, last: bytes | None) -> str:
    """Pure: may an authentic state of sequence ``seq`` be used by an agent that has seen up
    to ``seen`` (its newest state ``last``)? "" if so (newer, or the one it has); else why
    not: an older state of this job written back (a replay), or one written from an older
    state than this agent's (a refused read that became the base of another's write)."""
    if seq > seen or (seq == seen and state == last):
        return ""
    return f"sequence {seq}; this agent has seen {seen}"


class StateSeal:
    """Seals state bytes for one rendezvous id and opens what is read back.

    Each sealed state carries a sequence number, one more than the state it was written
    from (``close``: this agent's newest, the base of every write it makes). ``open`` never
    raises: a value that is not this job's (``ABSENT``, a forgery, garbage, another job's
    state), or one of this job's that is not newer than what this agent saw
    (``freshness``: replayed, or written from a refused read), gives the newest authentic
    state this agent saw, else a fresh one; what is refused is logged (``refused`` counts
    it). ``where`` names the store key, for the log. ``clock`` is ``time.monotonic`` unless
    a test passes another."""

    def __init__(self, key: bytes, run_id: str, where: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.job_key, self._key, self._context = key, key, b"rendezvous-state:" + run_id.encode()
        self.run_id, self.where, self._clock = run_id, where or f"torch.rendezvous.{run_id}", clock
        self._last: bytes | None = None
        self._seq = -1  # the sequence number of ``_last``
        self.beside: Any = None  # our fields beside the state last opened (``rendezvous.rules.Ours``): ``pack``
        self.last_sealed: bytes | None = None  # the stored form of ``_last`` (base64)
        self._logged: dict[str, tuple[float, int]] = {}  # kind -> (last logged, not logged since)
        self.refused = 0

    def close(self, state: bytes) -> bytes:
        """``state`` sealed as the successor of this agent's newest state, with ``beside``."""
        return jobkey.seal(self._key, (self._seq + 1).to_bytes(8, "big") + pack(state, self.beside), self._context)

    def open(self, stored: bytes) -> bytes:
        """``stored``: the value as kept in the store (base64 text, or anything at all)."""
        sealed = self._unseal(stored)
        why = "" if sealed is None else freshness(*sealed, self._seq, self._last)
        if sealed is not None and not why:
            self._seq, self._last, self.last_sealed = sealed[0], sealed[1], bytes(stored)
            return self._take(sealed[1])
        if sealed is not None:
            self.refused += 1
            self.warn("replayed", f"refused an older rendezvous state of '{self.run_id}' ({why}) in the "
                      f"store key '{self.where}': a state of this job written back, or written from an older "
                      "one; ignoring it and keeping the newest authentic state")
        elif stored != ABSENT or self._last is not None:  # the marker is no one's once a state was seen
            self.refused += 1
            self.warn("refused", f"refused rendezvous state of '{self.run_id}' not signed with this job's key "
                      f"({len(stored)} bytes, forged or corrupt, in the store key '{self.where}'); "
                      "ignoring it and keeping the last authentic state")
        return self.fallback()

    def usable(self, stored: bytes) -> bool:
        """Would ``open`` take ``stored`` as this agent's newest state? (No side effects.)"""
        sealed = self._unseal(stored)
        return sealed is not None and not freshness(*sealed, self._seq, self._last)

    def authentic(self, stored: bytes) -> bytes | None:
        """The state sealed in ``stored``, or None when it is not this job's (never raises)."""
        sealed = self._unseal(stored)
        return None if sealed is None else unpack(sealed[1])[0]

    def _unseal(self, stored: bytes) -> tuple[int, bytes] | None:
        try:
            payload = jobkey.unseal(self._key, b64decode(stored, validate=True), self._context)
        except (binascii.Error, ValueError, TypeError):
            return None
        if payload is None or len(payload) < 8:
            return None
        return int.from_bytes(payload[:8], "big"), payload[8:]

    def deleted(self) -> None:
        """Log (rate-limited, ``warn``) that the state's key was found deleted; the backend
        writes it again from ``last_sealed``."""
        self.warn("deleted", f"the rendezvous state of '{self.run_id}' was deleted from the store "
                  f"(key '{self.where}'); writing it again from this agent's last authentic state")

    def fallback(self) -> bytes:
        """The last authentic state, else a fresh one (what a refused value reads as), with
        what was beside it (nothing beside a fresh one)."""
        if self._last is None:
            self.beside = None
            return rdzv.fresh_state()
        return self._take(self._last)

    def _take(self, packed: bytes) -> bytes:
        """torch's state in ``packed`` (authentic); ``beside`` becomes what was sealed with it."""
        state, self.beside = unpack(packed)
        return state

    def warn(self, kind: str, message: str) -> None:
        """Log ``message`` now, unless a line of this ``kind`` went out within ``LOG_EVERY_S``:
        then count it, and the next line of that kind after the window says how many more
        there were (a writer in a loop is named, and does not flood the log)."""
        now = self._clock()
        logged_at, unlogged = self._logged.get(kind, (None, 0))
        if logged_at is not None and now - logged_at < LOG_EVERY_S:
            self._logged[kind] = (logged_at, unlogged + 1)
            return
        if unlogged:
            message += (f" ({unlogged} more in the last {now - logged_at:.0f} s: a process outside the job "
                        f"keeps writing '{self.where}', and the agents cannot agree on the rendezvous while "
                        "it does; find it among the store's connections)")
        self._logged[kind] = (now, 0)
        log.warning(message)


def pack(state: bytes, beside: Any) -> bytes:
    """Our fields beside torch's pickled state (``StateSeal.beside``) and that state, as one
    payload to seal: torch's bytes come last, unchanged, and nothing of ours is set on its object."""
    ours = pickle.dumps(beside)
    return len(ours).to_bytes(8, "big") + ours + state


def unpack(payload: bytes) -> tuple[bytes, Any]:
    """``pack`` undone: (torch's state, our fields). Only ever called on an authentic payload
    (the job's seal checked): our fields are unpickled only when the job's own agents wrote them."""
    size = int.from_bytes(payload[:8], "big")
    return payload[8 + size:], pickle.loads(payload[8:8 + size])


class SealedC10dBackend(Announcing, RendezvousBackend):
    """torch's c10d backend (``C10dRendezvousBackend``, same key and protocol) with the state
    sealed, written on torch's public backend interface.

    The token is the exact value last read from the store, whatever it is: a compare-and-set
    with it replaces that value, so an agent that read a forgery or garbage overwrites it at
    its next write, and the agents' writes converge as with torch's own backend. Reading
    never blocks on a missing key: a read is a compare-and-set that recreates a deleted key
    from this agent's last authentic state (torch's ``get`` waited ``read_timeout`` for it,
    and a job whose key was deleted blocked at its end), after a ``check`` that notices the
    deletion for the log; a write that finds the key deleted (the store then answers with
    the expected value: see c10d's ``compare_set``) recreates it with the new state."""

    def __init__(self, store: Any, run_id: str, seal: StateSeal,
                 connect: Callable[[], Any] | None = None) -> None:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        self._store, self._seal = store, seal
        self._key = "torch.rendezvous." + run_id
        # Word of each change pushed to every agent (``rendezvous.changes``); a file store polls.
        self._init_announcing(ChangeSignal(store, self._key, connect, seal.job_key, seal.warn)
                              if connect is not None else None)
        self._call("compare_set", self._key, "", ABSENT)

    @property
    def name(self) -> str:
        return "harness-c10d"

    def get_state(self) -> tuple[bytes, Token] | None:
        self._note_version()
        if not self._call("check", [self._key]):
            self._seal.deleted()
        stored = self._call("compare_set", self._key, "", self._seal.last_sealed or ABSENT)
        return self._seal.open(stored), stored

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        if token is not None and not isinstance(token, bytes):
            return *self.get_state(), False  # not a token of ours: it cannot match (as torch)
        expected, desired = token or ABSENT, b64encode(self._seal.close(state))
        worth = self.changes is not None and self.worth_announcing()
        self._note_version()
        stored = self._call("compare_set", self._key, expected, desired)
        if stored == expected != desired:  # the key is gone: the store echoes ``expected``
            self._seal.deleted()
            stored = self._call("compare_set", self._key, "", desired)
        if stored == desired and worth:
            self.changes.announce()
        return self._seal.open(stored), stored, stored == desired

    def _call(self, op: str, *args: Any) -> Any:
        try:
            return getattr(self._store, op)(*args)
        except (ValueError, RuntimeError, TimeoutError) as exc:
            raise RendezvousConnectionError(
                "The connection to the C10d store has failed. See inner exception for details.") from exc


def _c10d_client(params: RendezvousParameters) -> TCPStore:
    """One more client of the c10d store (``rendezvous.changes``' waiting thread)."""
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    timeout = timedelta(seconds=params.get_as_int("read_timeout", 60) or 60)
    return TCPStore(host, port, is_master=False, multi_tenant=True, timeout=timeout)


def _c10d_store(params: RendezvousParameters) -> TCPStore:
    """torch's ``_create_tcp_store``, the server bound to the endpoint's host (module doc)."""
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    configured = params.get_as_bool("is_host")
    is_host = configured if configured is not None else rdzv.matches_this_host(host)
    read_timeout = params.get_as_int("read_timeout", 60) or 60
    timeout = timedelta(seconds=read_timeout)
    # As torch: a guessed host that cannot serve (another agent on this machine does) joins.
    for is_server in [is_host, False]:
        try:
            if not is_server:
                return TCPStore(host, port, is_master=False, multi_tenant=True, timeout=timeout)
            sock = listener(host, port)
            return TCPStore(host, port, is_master=True, multi_tenant=True, timeout=timeout,
                            master_listen_fd=sock.detach())
        except (ValueError, RuntimeError, TimeoutError, OSError) as exc:
            if not is_server or configured is not None:
                raise RendezvousConnectionError(
                    f"The connection to the C10d store at {host}:{port} has failed: {exc}") from exc
    raise AssertionError("unreachable")


def create_c10d_backend(params: RendezvousParameters, seal: StateSeal) -> tuple[Any, Any]:
    if params.get("store_type", "tcp").strip().lower() == "file":
        if not params.endpoint:
            raise ValueError("a file store (store_type=file) needs the endpoint to name its file")
        store: Any = FileStore(params.endpoint)
        return SealedC10dBackend(store, params.run_id, seal), store
    store = _c10d_store(params)
    return SealedC10dBackend(store, params.run_id, seal, connect=lambda: _c10d_client(params)), store


class SealedEtcdBackend(RendezvousBackend):
    """The state in one key of etcd's v2 API (module doc); ``client`` is python-etcd's."""

    TTL_S = 7200

    def __init__(self, client: Any, run_id: str, seal: StateSeal,
                 key_prefix: str = "/torch/elastic/rendezvous") -> None:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        self._client, self._seal, self._key = client, seal, f"{key_prefix}/{run_id}"

    @property
    def name(self) -> str:
        return "harness-etcd-v2"

    def get_state(self) -> tuple[bytes, Token] | None:
        """The state; a key deleted after this agent saw an authentic state is written again
        from it (as ``SealedC10dBackend``: a deleted key must not read as a fresh rendezvous)."""
        got = self._read()
        if got is None and self._seal.last_sealed is not None:
            self._seal.deleted()
            last = self._seal.fallback()
            restored = self.set_state(last)  # create-only: another agent's rewrite wins
            return None if restored is None else restored[:2]
        return None if got is None else (self._seal.open(got[0]), got[1])

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        stored = b64encode(self._seal.close(state))
        when = {"prevIndex": token} if isinstance(token, int) and token else {"prevExist": False}
        try:
            result = self._etcd(lambda: self._client.write(self._key, stored.decode(), self.TTL_S, **when))
        except _Lost:  # another agent wrote first (or the key exists): what is there now
            got = self._read()
            return None if got is None else (self._seal.open(got[0]), got[1], False)
        return self._seal.open(_text(result)), result.modifiedIndex, True

    def _read(self) -> tuple[bytes, int] | None:
        import etcd

        try:
            result = self._etcd(lambda: self._client.read(self._key))
        except _Lost:
            return None
        except etcd.EtcdKeyNotFound:
            return None
        return _text(result), result.modifiedIndex

    @staticmethod
    def _etcd(call: Callable[[], Any]) -> Any:
        import etcd
        import urllib3

        try:
            return call()
        except (etcd.EtcdAlreadyExist, etcd.EtcdCompareFailed) as exc:
            raise _Lost from exc
        except etcd.EtcdKeyNotFound:
            raise
        except (etcd.EtcdException, urllib3.exceptions.TimeoutError) as exc:
            raise RendezvousConnectionError(
                "The connection to etcd has failed. See inner exception for details.") from exc


class _Lost(Exception):
    """An etcd compare-and-swap another agent won."""


def _text(result: Any) -> bytes:
    return str(result.value or "").encode("utf-8", "surrogatepass")


def etcd_client(params: RendezvousParameters) -> Any:
    """python-etcd's client for the endpoint, as the config asks (``launch.config``, torch's
    keys): ``protocol`` (http or https), ``ca_cert``, ``ssl_cert`` and ``ssl_cert_key``
    (a client certificate), ``read_timeout`` seconds."""
    import etcd
    import urllib3

    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=2379)
    read_timeout = params.get_as_int("read_timeout", 60) or 60
    protocol = (params.get("protocol") or "http").strip().lower()
    if protocol not in ("http", "https"):
        raise ValueError(f"etcd protocol '{protocol}' is neither http nor https")
    cert = params.get("ssl_cert")
    if cert and params.get("ssl_cert_key"):
        cert = (cert, params.get("ssl_cert_key"))
    try:
        return etcd.Client(host, port, read_timeout=read_timeout, protocol=protocol, cert=cert,
                           ca_cert=params.get("ca_cert"), allow_reconnect=True)
    except (etcd.EtcdException, urllib3.exceptions.TimeoutError) as exc:
        raise RendezvousConnectionError(
            "The connection to etcd has failed. See inner exception for details.") from exc


def create_etcd_backend(params: RendezvousParameters, seal: StateSeal) -> tuple[Any, Any]:
    """The etcd-v2 backend and torch's ``EtcdStore`` over the same client (module doc)."""
    from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore

    client = etcd_client(params)
    return SealedEtcdBackend(client, params.run_id, seal), EtcdStore(client, "/torch/elastic/store")
