"""The rendezvous backends: per backend, every fact the package decides by its name.

Pure data; the code that uses a backend reads its row here instead of comparing names:
the spec's choices (``schema.RendezvousSpec.backend``), the launch configuration
(``launch.config``: torch's name, the default port, the settings it passes), the extras a
job needs (``deps``), the agent's lines when a backend cannot be reached (``agent.node``),
the store host (``simcluster``, Slurm, Kubernetes) and our handler in torch's registry
(``rendezvous.handler``). A new backend is one row here and its state backend in
``rendezvous.handler``.

A backend has three names: the spec's (``rendezvous.backend``, ``--rdzv-backend``, what the
Kubernetes operator passes on), torch's (``RendezvousParameters.backend`` and the agent's
``rdzv_backend``: ``etcd`` becomes ``etcd-v3``, ours on etcd's v3 API) and our handler's in
torch's handler registry (``harness-c10d``: torch's own ``c10d`` and ``etcd-v2`` stay torch's).
"""

from __future__ import annotations

from dataclasses import dataclass

# The rendezvous settings every etcd backend passes on: torch's etcd-v2 backend reads these
# keys and ours (etcd-v3) the same ones; paths only, never key material. (key, spec field,
# passed even when empty); isolation_timeout: how long calls ride out an etcd down.
_ETCD_SETTINGS = (("protocol", "etcd_protocol", True), ("isolation_timeout", "isolation_timeout", True),
                  ("ca_cert", "etcd_ca_cert", False), ("ssl_cert", "etcd_cert", False),
                  ("ssl_cert_key", "etcd_key", False))


@dataclass(frozen=True)
class Backend:
    name: str  # the spec's word: rendezvous.backend, --rdzv-backend, the operator's rdzvBackend
    torch_name: str  # torch's RendezvousParameters.backend, the agent's rdzv_backend
    registered: str  # our handler's name in torch's rendezvous handler registry
    port: int  # what an endpoint without a port gets (torchrun's c10d default, etcd's client port)
    hosts_store: bool  # the store lives in one agent of the job (else: a server outside it)
    settings: tuple[tuple[str, str, bool], ...]  # its rendezvous config keys: (key, spec.rendezvous field, always)
    extra: str = ""  # the package extra (deps.EXTRAS) its client needs
    with_user: bool = False  # takes etcd_user and etcd_password_file (authentication)
    # The word in a failure's detail that means the server answers without the API this
    # backend speaks: a configuration error, not an outage.
    refused_word: str = ""
    unreachable_fix: str = ""  # what to do when it cannot be reached at start-up


BACKENDS: tuple[Backend, ...] = (
    Backend("c10d", "c10d", "harness-c10d", 29400, hosts_store=True, settings=(),
            unreachable_fix="start the agent that hosts the c10d store (--is-host) first, at that address, "
                            "or fix rendezvous.endpoint (--rdzv-endpoint)"),
    Backend("etcd", "etcd-v3", "etcd-v3", 2379, hosts_store=False, with_user=True,
            settings=(*_ETCD_SETTINGS, ("user", "etcd_user", False), ("password_file", "etcd_password_file", False)),
            unreachable_fix="start etcd there (3.4 or newer: the v3 API), or fix rendezvous.endpoint "
                            "(--rdzv-endpoint; name every member, comma-separated)"),
    Backend("etcd-v2", "etcd-v2", "harness-etcd-v2", 2379, hosts_store=False, settings=_ETCD_SETTINGS,
            extra="etcd", refused_word="404",
            unreachable_fix="start etcd there with --enable-v2 (torch's etcd-v2 rendezvous speaks the v2 API: "
                            "etcd 3.4 or 3.5; 3.6 has none), or fix rendezvous.endpoint (--rdzv-endpoint)"),
)

NAMES = tuple(b.name for b in BACKENDS)  # the spec's choices, in this order
BY_NAME = {b.name: b for b in BACKENDS}
BY_TORCH_NAME = {b.torch_name: b for b in BACKENDS}
RENDERED_ETCD = BY_NAME["etcd"]  # what Kubernetes' rendered etcd (3.6: the v3 API only) serves
WITH_USER = tuple(b.name for b in BACKENDS if b.with_user)  # those that take etcd_user
