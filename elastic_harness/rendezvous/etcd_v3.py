"""The etcd v3 rendezvous backend: torch's dynamic rendezvous, its state in etcd's v3 API.

``EtcdV3Backend`` is a ``RendezvousBackend`` (torch's public interface: ``get_state`` and
``set_state`` with a fencing token); torch's ``DynamicRendezvousHandler`` does everything
else, as with its own c10d and etcd-v2 backends (``rendezvous.handler`` builds it and names
``etcd-v3`` in torch's handler registry). Spoken through the gateway of
``rendezvous.etcd_gateway`` (why no client library: there).

- The state lives under ``/torch/elastic/rendezvous/<run id>``, sealed under the job's key
  (``rendezvous.sealed.StateSeal``: the same stored form as the etcd-v2 and c10d backends, a
  forged or corrupt value refused before torch unpickles it).
- A refused value (``StateSeal`` refuses forgeries, garbage and older states of the job
  written back) never becomes the base of a write (a burst of garbage with a worker
  crash inside it split the agents for good, 4 of 7 runs): the base is the newest value of the
  key's history the agent may use (etcd keeps every revision), and the token the refused
  value's revision, so the agent's next write replaces it with what it replaced.
- ``set_state`` is one transaction: compare the key's mod revision with the token (or, with
  no token, that the key does not exist), put on success, read the key on failure. So a
  lost race costs one round trip, not two; the token is the mod revision it returns.
- Keys with leases: every key this backend writes (the state, and the store's keys) rides
  on the agent's lease (``Lease``, ``STATE_TTL_S``), granted on first write and renewed with
  ``lease/keepalive`` on the keep-alive beat torch already runs (each keep-alive writes the
  state). When every agent of a rendezvous is gone, the last lease lapses and its keys go
  with it: etcd v2's TTL, which torch's etcd-v2 backend sets to two hours, the same here.
  Which nodes are alive stays torch's own decision, from the keep-alive times in the state.

- Changes pushed (``EtcdChanges``, ``rendezvous.changes``): a write the handler judges worth
  announcing also puts ``<state key>.changes`` in its transaction; each agent watches that
  key, so its join's poll and its monitor wait end at the change.

``EtcdV3Store`` is the ``torch.distributed.Store`` the handler hands to the agent (the
master address of each round, the exit barrier): keys under ``/torch/elastic/store/``,
``get``/``wait`` poll (5 ms, doubling to 100 ms) until the keys exist or the store's timeout.
Its values are not sealed: torch reads them as text and JSON, never unpickles them.

Errors: no member reachable is torch's ``RendezvousConnectionError`` (exit 200, retry);
settings that etcd refuses are ``EtcdMisconfigured``, a ``RendezvousError`` whose message
is the one line to show (exit 2): ``create_backend`` probes etcd once, so a wrong password,
TLS asked of a plain etcd, or an etcd without the v3 API ends the agent before it joins.

Call order: ``create_backend(params, seal)`` once per agent; torch then calls the backend's
``get_state``/``set_state`` from its join, keep-alive and close operations, from the
agent's main thread and its keep-alive thread (the gateway is thread-safe).
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from torch.distributed import DistStoreError, Store
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

from elastic_harness.rendezvous.changes import Announcing, PushedChanges
from elastic_harness.rendezvous.etcd_gateway import (
    EtcdError,
    EtcdRefused,
    EtcdUnavailable,
    Gateway,
    Settings,
    Watch,
    b64,
    unb64,
)

BACKEND = "etcd-v3"  # the name in torch's handler registry and in RendezvousParameters
STATE_PREFIX = "/torch/elastic/rendezvous"  # as torch's etcd-v2 backend
STORE_PREFIX = "/torch/elastic/store/"
CHANGES_SUFFIX = b".changes"  # the key each counted change puts (``EtcdChanges``)
STATE_TTL_S = 7200  # torch's etcd-v2 backend keeps the state this long after its last write
_NOT_FOUND = 5  # etcd's gRPC code for a lease it no longer has
_POLL_FIRST_S, _POLL_MAX_S = 0.005, 0.1
# Reads back through the state key's history for the newest value an agent may use, after it
# refused the current one (``EtcdV3Backend._history``): a burst of more writes than that since
# the last authentic one leaves the agent its own newest state (``rendezvous.sealed.freshness``
# then sorts out whose is newer).
HISTORY_READS = 64


class EtcdMisconfigured(RendezvousError):
    """etcd refused the job's settings (``etcd_gateway.EtcdRefused``): a mistake to fix, not
    a failure to retry. Its message is the one line for the user."""


def _call(gateway: Gateway, path: str, body: dict) -> dict:
    """``gateway.call`` with torch's rendezvous errors."""
    try:
        return gateway.call(path, body)
    except EtcdRefused as e:
        raise EtcdMisconfigured(str(e)) from None
    except EtcdUnavailable as e:
        raise RendezvousConnectionError(f"The connection to etcd has failed: {e}") from None
    except EtcdError as e:
        raise RendezvousConnectionError(f"etcd refused a request: {e}") from None


class Lease:
    """This agent's lease (module doc): ``id()`` grants it on first use and renews it once
    a third of its TTL has passed; ``lost()`` after etcd said it no longer has it."""

    def __init__(self, gateway: Gateway, ttl_s: int = STATE_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._gateway, self._ttl, self._clock = gateway, ttl_s, clock
        self._id: str | None = None
        self._renewed = 0.0
        self._lock = threading.Lock()

    def id(self) -> str:
        with self._lock:
            now = self._clock()
            if self._id is not None and now - self._renewed > self._ttl / 3:
                reply = _call(self._gateway, "lease/keepalive", {"ID": self._id})
                # the gateway streams keep-alive answers: one JSON object under "result"
                alive = int(reply.get("result", reply).get("TTL", 0) or 0) > 0
                self._id, self._renewed = (self._id, now) if alive else (None, now)
            if self._id is None:
                reply = _call(self._gateway, "lease/grant", {"TTL": self._ttl})
                self._id, self._renewed = str(reply["ID"]), now
            return self._id

    def lost(self) -> None:
        with self._lock:
            self._id = None


def _with_lease(lease: Lease, write: Callable[[str], dict]) -> dict:
    """``write(lease id)`` (a gateway call) with torch's errors; once more with a new lease
    if etcd no longer had the old one (it lapsed while this agent was stopped)."""
    for attempt in (0, 1):
        try:
            return write(lease.id())
        except EtcdRefused as e:
            raise EtcdMisconfigured(str(e)) from None
        except EtcdUnavailable as e:
            raise RendezvousConnectionError(f"The connection to etcd has failed: {e}") from None
        except EtcdError as e:
            if e.code != _NOT_FOUND or attempt:
                raise RendezvousConnectionError(f"etcd refused a write: {e}") from None
            lease.lost()
    raise AssertionError("unreachable")


class EtcdChanges(PushedChanges):
    """Word of the rendezvous' counted changes from etcd (``rendezvous.changes``): a write worth
    announcing also puts the change key in its transaction (``EtcdV3Backend._swap``), and one
    thread per agent watches that key (``etcd_gateway.Watch``); the version is the key's mod
    revision. The watch starts right after the revision its first read saw, so no change
    between the read and the watch is missed. A watch that ends (its member went away)
    leaves the agent to its polls."""

    def __init__(self, gateway: Gateway, key: bytes) -> None:
        super().__init__()
        self._gateway, self.key = gateway, key
        self._watch: Watch | None = None

    def _follow(self) -> None:
        reply = self._gateway.call("kv/range", {"key": b64(self.key)})
        kvs = reply.get("kvs")
        self._watch = self._gateway.watch(self.key, int(reply["header"]["revision"]) + 1)
        self._begin(int(kvs[0]["mod_revision"]) if kvs else 0)
        if self._stopped:  # closed while the watch was opening
            self._watch.close()
        for revision in self._watch.revisions():
            self._changed(revision)

    def _release(self) -> None:
        watch = self._watch
        if watch is not None:
            watch.close()


class EtcdV3Backend(Announcing, RendezvousBackend):
    """torch's rendezvous state in one etcd key (module doc). ``seal``: a
    ``rendezvous.sealed.StateSeal`` (``close`` state -> sealed bytes, ``open`` stored text ->
    state bytes, never raising). Its counted changes are pushed (``EtcdChanges``)."""

    def __init__(self, gateway: Gateway, run_id: str, seal: Any, lease: Lease) -> None:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        self._gateway, self._seal, self._lease = gateway, seal, lease
        self.key = f"{STATE_PREFIX}/{run_id}".encode()
        self._init_announcing(EtcdChanges(gateway, self.key + CHANGES_SUFFIX))

    @property
    def name(self) -> str:
        return BACKEND

    def get_state(self) -> tuple[bytes, Any] | None:
        """The state; a key deleted after this agent saw an authentic state (by hand, or a
        lease that ended) is written again from it, create-only, so that it never reads as a
        fresh rendezvous (a closed one reopened)."""
        self._note_version()
        kvs = _call(self._gateway, "kv/range", {"key": b64(self.key)}).get("kvs")
        if kvs or self._seal.last_sealed is None:
            return self._decode(kvs[0]) if kvs else None
        self._seal.deleted()
        restored = self.set_state(self._seal.fallback())
        return None if restored is None else restored[:2]

    def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
        if token is not None:
            try:
                token = int(token)
            except (TypeError, ValueError):  # not one of ours: the write cannot be fenced
                current = self.get_state()
                return (*current, False) if current is not None else None
        stored = base64.b64encode(self._seal.close(state))  # the stored text, as v2 and c10d keep it
        announce = self.worth_announcing()
        self._note_version()
        reply = _with_lease(self._lease, lambda lease: self._swap(stored, token, lease, announce))
        if reply.get("succeeded"):  # opened as read back: this agent's last authentic state
            return self._seal.open(stored), int(reply["header"]["revision"]), True
        kvs = reply["responses"][0]["response_range"].get("kvs")
        return (*self._decode(kvs[0]), False) if kvs else None

    def _swap(self, stored: bytes, token: int | None, lease: str, announce: bool = False) -> dict:
        """The compare-and-swap (module doc); ``announce``: the change key is put in the same
        transaction, and every agent's watch of it wakes (``EtcdChanges``)."""
        key = b64(self.key)
        compare = ({"key": key, "target": "CREATE", "create_revision": "0", "result": "EQUAL"} if token is None
                   else {"key": key, "target": "MOD", "mod_revision": str(token), "result": "EQUAL"})
        success = [{"request_put": {"key": key, "value": b64(stored), "lease": lease}}]
        if announce:
            success.append({"request_put": {"key": b64(self.key + CHANGES_SUFFIX), "value": "", "lease": lease}})
        txn = {"compare": [compare], "success": success, "failure": [{"request_range": {"key": key}}]}
        return self._gateway.call("kv/txn", txn)

    def _decode(self, kv: dict) -> tuple[bytes, int]:
        """The state in ``kv`` and its token. A value the seal refuses (a forgery, garbage, an
        older state written back) is never the base of this agent's next write: the base is
        the newest value of the key's history this agent may use (``_history``), and the
        token stays the refused value's revision, so that write replaces it."""
        stored, revision = unb64(kv.get("value", "")), int(kv["mod_revision"])
        if self._seal.usable(stored):
            return self._seal.open(stored), revision
        earlier = self._history(revision)
        state = self._seal.open(stored)  # logs the refusal; this agent's newest state
        return (self._seal.open(earlier) if earlier is not None else state), revision

    def _history(self, revision: int) -> bytes | None:
        """The newest stored value of the state key before ``revision`` that this agent may use
        (etcd keeps every revision until compacted): at most ``HISTORY_READS`` reads back,
        None past them, before the key existed, or once etcd compacted it."""
        key = b64(self.key)
        for _ in range(HISTORY_READS):
            if revision <= 1:
                return None
            try:
                kvs = self._gateway.call("kv/range", {"key": key, "revision": str(revision - 1)}).get("kvs")
            except EtcdError:  # compacted (or etcd went away: the caller's next call says so)
                return None
            if not kvs:
                return None
            stored = unb64(kvs[0].get("value", ""))
            if self._seal.usable(stored):
                return stored
            revision = int(kvs[0]["mod_revision"])
        return None


class EtcdV3Store(Store):
    """torch's ``Store`` over etcd's v3 API (module doc); the interface of torch's etcd-v2
    ``EtcdStore``: ``set``, ``get``, ``add``, ``wait``, ``check``."""

    def __init__(self, gateway: Gateway, lease: Lease, prefix: str = STORE_PREFIX,
                 timeout: timedelta | None = None) -> None:
        super().__init__()  # required by torch's pybind trampoline
        self._gateway, self._lease, self._prefix = gateway, lease, prefix.encode()
        if timeout is not None:
            self.set_timeout(timeout)

    def _key(self, key: str | bytes) -> str:
        return b64(self._prefix + (key.encode() if isinstance(key, str) else key))

    def set(self, key: str | bytes, value: str | bytes) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        _with_lease(self._lease, lambda lease: self._put(self._key(key), data, lease))

    def _put(self, key: str, data: bytes, lease: str) -> dict:
        return self._gateway.call("kv/put", {"key": key, "value": b64(data), "lease": lease})

    def get(self, key: str | bytes) -> bytes:
        return self._wait_get([key], self.timeout)[0]

    def add(self, key: str | bytes, num: int) -> int:
        """Atomically add ``num`` to the decimal number under ``key`` (0 if absent)."""
        k = self._key(key)
        while True:
            kvs = _call(self._gateway, "kv/range", {"key": k}).get("kvs")
            value = int(unb64(kvs[0]["value"])) + num if kvs else num
            compare = ({"key": k, "target": "MOD", "mod_revision": kvs[0]["mod_revision"], "result": "EQUAL"}
                       if kvs else {"key": k, "target": "CREATE", "create_revision": "0", "result": "EQUAL"})

            def swap(lease: str, compare: dict = compare, value: int = value) -> dict:
                put = {"key": k, "value": b64(str(value)), "lease": lease}
                return self._gateway.call("kv/txn", {"compare": [compare], "success": [{"request_put": put}]})

            if _with_lease(self._lease, swap).get("succeeded"):
                return value

    def wait(self, keys: list, override_timeout: timedelta | None = None) -> None:
        self._wait_get(keys, override_timeout or self.timeout)

    def check(self, keys: list) -> bool:
        return self._read(keys) is not None

    def _read(self, keys: list) -> list[bytes] | None:
        """The values of ``keys`` in one transaction, or None while any is missing."""
        txn = {"compare": [], "success": [{"request_range": {"key": self._key(k)}} for k in keys]}
        responses = _call(self._gateway, "kv/txn", txn).get("responses", [])
        values = [(r.get("response_range") or {}).get("kvs") for r in responses]
        if len(values) != len(keys) or not all(values):
            return None
        return [unb64(kvs[0].get("value", "")) for kvs in values]

    def _wait_get(self, keys: list, timeout: timedelta) -> list[bytes]:
        deadline = time.monotonic() + timeout.total_seconds()
        pause = _POLL_FIRST_S
        while True:
            values = self._read(keys)
            if values is not None:
                return values
            if time.monotonic() + pause > deadline:
                raise DistStoreError(f"Timeout after {timeout.total_seconds():.0f}s waiting for keys "
                                     f"{list(keys)} in the etcd v3 store")
            time.sleep(pause)
            pause = min(2 * pause, _POLL_MAX_S)


def read_password(path: str) -> str:
    """The password in the job's password file (its last line end dropped)."""
    try:
        return Path(path).read_text().rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as e:
        raise EtcdMisconfigured(f"cannot read rendezvous.etcd_password_file '{path}': "
                                f"{getattr(e, 'strerror', None) or e}; name a readable file holding "
                                "the etcd user's password") from None


def gateway_for(params: RendezvousParameters) -> Gateway:
    """A gateway for the rendezvous config's etcd (``launch.config.rdzv_configs``)."""
    conf = params.config
    password = read_password(str(conf["password_file"])) if conf.get("password_file") else ""
    try:
        return Gateway(Settings.from_conf(params.endpoint, conf, password))
    except EtcdRefused as e:
        raise EtcdMisconfigured(str(e)) from None


def create_backend(params: RendezvousParameters, seal: Any) -> tuple[EtcdV3Backend, EtcdV3Store]:
    """The backend and store for ``params`` (what torch's own ``create_backend`` functions
    return), after one read through every setting (module doc: errors)."""
    gateway = gateway_for(params)
    lease = Lease(gateway)
    backend = EtcdV3Backend(gateway, params.run_id, seal, lease)
    backend.get_state()  # TLS, authentication, the v3 API and the permission to read, at once
    gateway.learn_members()
    return backend, EtcdV3Store(gateway, lease)
