"""Rendezvous backends of our own (c10d, etcd-v2) with the state authenticated by the job's key.

torch's dynamic rendezvous pickles its state (``_BackendRendezvousStateHolder``) and hands
the bytes to a ``RendezvousBackend`` (torch's public interface: ``name``, ``get_state``,
``set_state``), which keeps them under one key of the c10d store or etcd; on every sync it
reads them back and ``pickle.loads`` them. Anyone who can write that key could make every
agent run code (issue 22: a forged pickle ran a shell command within 1 s; garbage ended the
job). So the backends here are ours, on that public interface, not torch's classes:

- ``SealedBackend`` keeps the state as base64 text of ``HMAC(key, run id, state) || state``
  (``jobkey.seal``) in a compare-and-set register that a subclass provides (``read``,
  ``write``), and checks the tag of every value read back before torch sees it. A value that
  is not base64 text, or not sealed with this job's key for this rendezvous id, is refused
  with one logged line (per distinct value, so a forged value that stays put is not logged
  at every poll) and replaced by the last authentic state this agent saw (before it saw any:
  no state, ``b""``, from which torch makes a fresh one). The register's token is the value
  actually stored, so the agent's next write replaces the forged value, and the job goes on.
  Nothing about the seal depends on the store: a backend for another store (etcd v3, ...)
  subclasses ``SealedBackend`` with its own ``read``/``write``.
- ``SealedC10dBackend``: the register is one key of a c10d ``Store`` (torch's key,
  ``torch.rendezvous.<run id>``), read and written with ``compare_set`` only, so a deleted
  key reads as no state at once instead of blocking a ``get`` until the store's timeout.
- ``SealedEtcdBackend``: one key of etcd's v2 API, written with ``prevIndex``/``prevExist``
  and a TTL (two hours), as torch's etcd-v2 backend does.

``has_set`` (whether this agent's own write won) is true only for an authentic value equal
to what it wrote. Each backend's ``name`` is the one ``launch.rendezvous`` registers its
handler under in torch's rendezvous handler registry (``harness-c10d``, ``harness-etcd-v2``).

The c10d store itself: ``create_c10d_backend`` is torch's ``create_backend`` for a TCP
store, except that the agent hosting the store binds the endpoint's host (``listen``), not
every interface: ``127.0.0.1`` for a local run, the address the job gave its nodes
elsewhere. A file store (``store_type=file``) is torch's ``FileStore`` at the endpoint's path.
"""

from __future__ import annotations

import binascii
import logging
from base64 import b64decode, b64encode
from datetime import timedelta
from typing import Any

from torch.distributed import FileStore, TCPStore
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from elastic_harness import jobkey
from elastic_harness.listen import listener
from elastic_harness.torchcompat import rdzv

log = logging.getLogger(__name__)

NO_STATE = b""  # what a refused value reads as before any authentic state: torch makes a fresh one


class StateSeal:
    """Seals state bytes for one rendezvous id and opens what is read back.

    ``open`` never raises for a bad value: it logs once per distinct value and returns the
    last authentic state (``refused`` counts the refusals, for tests and the log)."""

    def __init__(self, key: bytes, run_id: str) -> None:
        self._key, self._context = key, b"rendezvous-state:" + run_id.encode()
        self._run_id = run_id
        self._last: bytes | None = None
        self._logged: bytes | None = None
        self.refused = 0

    def close(self, state: bytes) -> bytes:
        return jobkey.seal(self._key, state, self._context)

    def authentic(self, stored: bytes) -> bytes | None:
        """The state in ``stored`` (the value as kept: base64 text), None if refused."""
        try:
            payload = jobkey.unseal(self._key, b64decode(stored, validate=True), self._context)
        except (binascii.Error, ValueError, TypeError):
            payload = None
        if payload is not None:
            self._last = payload
            return payload
        self.refused += 1
        if stored != self._logged:
            self._logged = stored
            log.warning("refused rendezvous state of '%s' not signed with this job's key (%d bytes, "
                        "forged or corrupt); ignoring it and keeping the last authentic state",
                        self._run_id, len(stored))
        return None

    def open(self, stored: bytes) -> bytes:
        """The state in ``stored``, else the last authentic one (else ``NO_STATE``)."""
        payload = self.authentic(stored)
        return payload if payload is not None else self.fallback()

    def fallback(self) -> bytes:
        """What a refused value reads as: the last authentic state, else ``NO_STATE``."""
        return self._last if self._last is not None else NO_STATE


class SealedBackend(RendezvousBackend):
    """A ``RendezvousBackend`` over a compare-and-set register, the state sealed (module doc).

    Subclasses give ``name`` and two calls on the register, whose values are the stored
    bytes and whose token is whatever the store compares (it is handed back unchanged):
    ``read() -> (stored, token) | None`` (None: no state yet), and
    ``write(stored, token) -> (stored now, token now, won) | None``: replace the value if
    the register still holds ``token`` (None: if it holds no state)."""

    def __init__(self, seal: StateSeal) -> None:
        self.seal = seal

    def read(self) -> tuple[bytes, Any] | None:
        raise NotImplementedError

    def write(self, stored: bytes, token: Any) -> tuple[bytes, Any, bool] | None:
        raise NotImplementedError

    def get_state(self) -> tuple[bytes, Any] | None:
        got = self.read()
        if got is None:
            return None
        stored, token = got
        return self.seal.open(stored), token

    def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
        got = self.write(b64encode(self.seal.close(state)), token)
        if got is None:
            return None
        stored, token, _ = got
        payload = self.seal.authentic(stored)
        if payload is None:
            return self.seal.fallback(), token, False
        return payload, token, payload == state


class SealedC10dBackend(SealedBackend):
    """The state in one key of a c10d ``Store`` (module doc)."""

    ABSENT = b"<no rendezvous state>"  # never base64: cannot be mistaken for a state

    def __init__(self, store: Any, run_id: str, seal: StateSeal) -> None:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        super().__init__(seal)
        self._store, self._key = store, "torch.rendezvous." + run_id

    @property
    def name(self) -> str:
        return "harness-c10d"

    def _compare_set(self, expected: Any, desired: bytes) -> bytes:
        try:
            return self._store.compare_set(self._key, expected, desired)
        except (ValueError, RuntimeError, TimeoutError) as exc:
            raise RendezvousConnectionError(
                "The connection to the C10d store has failed. See inner exception for details.") from exc

    def read(self) -> tuple[bytes, Any] | None:
        stored = self._compare_set("", self.ABSENT)  # made absent if missing, read otherwise
        return None if stored == self.ABSENT else (stored, stored)

    def write(self, stored: bytes, token: Any) -> tuple[bytes, Any, bool] | None:
        now = self._compare_set(token if isinstance(token, bytes) and token else self.ABSENT, stored)
        if now == self.ABSENT:
            return None
        return now, now, now == stored


class SealedEtcdBackend(SealedBackend):
    """The state in one key of etcd's v2 API (module doc); ``client`` is python-etcd's."""

    TTL_S = 7200

    def __init__(self, client: Any, run_id: str, seal: StateSeal,
                 key_prefix: str = "/torch/elastic/rendezvous") -> None:
        super().__init__(seal)
        self._client, self._key = client, f"{key_prefix}/{run_id}"

    @property
    def name(self) -> str:
        return "harness-etcd-v2"

    def read(self) -> tuple[bytes, Any] | None:
        import etcd
        import urllib3

        try:
            result = self._client.read(self._key)
        except etcd.EtcdKeyNotFound:
            return None
        except (etcd.EtcdException, urllib3.exceptions.TimeoutError) as exc:
            raise RendezvousConnectionError(
                "The connection to etcd has failed. See inner exception for details.") from exc
        return str(result.value).encode(), result.modifiedIndex

    def write(self, stored: bytes, token: Any) -> tuple[bytes, Any, bool] | None:
        import etcd
        import urllib3

        when = {"prevIndex": token} if isinstance(token, int) and token else {"prevExist": False}
        try:
            result = self._client.write(self._key, stored.decode(), self.TTL_S, **when)
        except (etcd.EtcdAlreadyExist, etcd.EtcdCompareFailed):
            got = self.read()
            return None if got is None else (*got, False)
        except (etcd.EtcdException, urllib3.exceptions.TimeoutError) as exc:
            raise RendezvousConnectionError(
                "The connection to etcd has failed. See inner exception for details.") from exc
        return str(result.value).encode(), result.modifiedIndex, True


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
    else:
        store = _c10d_store(params)
    return SealedC10dBackend(store, params.run_id, seal), store


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
