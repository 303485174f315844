"""torch's rendezvous backends (c10d, etcd-v2) with the state authenticated by the job's key.

torch's dynamic rendezvous pickles its state (``_BackendRendezvousStateHolder``) and hands
the bytes to a backend, which stores them base64-encoded under one key of the c10d store or
etcd; on every sync it reads them back and ``pickle.loads`` them. Anyone who can write that
key can make every agent run code (issue 22: a forged pickle ran a shell command within
1 s; garbage ended the job). Both backends here are torch's own classes with two changes:

- ``set_state`` stores ``HMAC(key, run id, state) || state`` (``jobkey.seal``);
- decoding a value read back (``_decode_state``, the one place both turn stored bytes into
  state bytes) checks that tag first. A value that is not base64, or not sealed with this
  job's key for this rendezvous id, is refused with one logged line (per distinct value,
  so a forged value that stays put is not logged at every poll) and replaced by the last
  authentic state this agent saw (a fresh, empty state before it saw any). The store's
  token is kept, so the agent's next write replaces the forged value, and the job goes on.

``has_set`` (whether this agent's own write won) is computed on the unsealed bytes, as
torch does on its own.

The c10d store itself: ``create_c10d_backend`` is torch's ``create_backend`` for a TCP
store, except that the agent hosting the store binds the endpoint's host (``listen``), not
every interface: ``127.0.0.1`` for a local run, the address the job gave its nodes
elsewhere. A file store (``store_type=file``) is torch's.
"""

from __future__ import annotations

import binascii
import logging
import pickle
from base64 import b64decode
from datetime import timedelta
from typing import Any

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState
from torch.distributed.elastic.rendezvous.utils import (
    _matches_machine_hostname,
    parse_rendezvous_endpoint,
)

from elastic_harness import jobkey
from elastic_harness.listen import listener

log = logging.getLogger(__name__)


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

    def open(self, stored: bytes) -> bytes:
        """``stored``: the value as kept in the store (base64 text)."""
        try:
            payload = jobkey.unseal(self._key, b64decode(stored, validate=True), self._context)
        except (binascii.Error, ValueError):
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
        return self._last if self._last is not None else pickle.dumps(_RendezvousState())


class SealedC10dBackend(C10dRendezvousBackend):
    """torch's c10d backend with the state sealed (module doc)."""

    def __init__(self, store: Any, run_id: str, seal: StateSeal) -> None:
        self._seal = seal
        super().__init__(store, run_id)

    def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
        result = super().set_state(self._seal.close(state), token)
        if result is None:
            return None
        new_state, new_token, _ = result
        return new_state, new_token, new_state == state

    def _decode_state(self, base64_state: bytes) -> tuple[bytes, Any] | None:
        if base64_state == self._NULL_SENTINEL.encode():
            return None
        return self._seal.open(base64_state), base64_state


def _c10d_store(params: RendezvousParameters) -> TCPStore:
    """torch's ``_create_tcp_store``, the server bound to the endpoint's host (module doc)."""
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    configured = params.get_as_bool("is_host")
    is_host = configured if configured is not None else _matches_machine_hostname(host)
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
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import _create_file_store

        store: Any = _create_file_store(params)
    else:
        store = _c10d_store(params)
    return SealedC10dBackend(store, params.run_id, seal), store


def create_etcd_backend(params: RendezvousParameters, seal: StateSeal) -> tuple[Any, Any]:
    """torch's etcd-v2 ``create_backend`` (its client: protocol and certificates from the
    config, ``launch.config.rdzv_configs``), with the state sealed."""
    from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import (
        EtcdRendezvousBackend,
        _create_etcd_client,
    )
    from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore

    class SealedEtcdBackend(EtcdRendezvousBackend):
        def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
            return super().set_state(seal.close(state), token)

        def _decode_state(self, result: Any) -> tuple[bytes, Any]:
            return seal.open(result.value.encode()), result.modifiedIndex

    client = _create_etcd_client(params)
    backend = SealedEtcdBackend(client, params.run_id, key_prefix="/torch/elastic/rendezvous")
    return backend, EtcdStore(client, "/torch/elastic/store")
