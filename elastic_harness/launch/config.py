"""Spec + per-node options -> torchelastic's ``LaunchConfig``.

The only module that knows torchrun's knobs: rendezvous configuration keys, the agent's
monitor interval and shutdown grace, log redirection, and how a worker is started. It starts
no processes and opens no connections, but not everything here is pure: ``new_rdzv_id`` is
random, ``agent_environ`` reads this process's environment, and ``launch_config`` creates the
log directory (torchelastic's ``DefaultLogsSpecs`` does) and, on torch without a shutdown
timeout field, sets ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` in this process's environment.
``node_options`` and ``rdzv_configs`` are pure.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from elastic_harness.errors import SpecError
from elastic_harness.spec import JobSpec

# torch's backend names: "etcd-v2" is the dynamic rendezvous on etcd's v2 API.
_BACKENDS = {"c10d": "c10d", "etcd": "etcd-v2", "etcd-v2": "etcd-v2"}
# The port an endpoint without one gets, per torch backend: torchrun's c10d default and
# etcd's client port (what torch's own rendezvous backends assume).
DEFAULT_PORTS = {"c10d": 29400, "etcd-v2": 2379}


@dataclass(frozen=True)
class NodeOptions:
    """What one agent needs beyond the spec. CLI flags, then PET_* env, then the spec."""

    run_dir: Path
    rdzv_endpoint: str
    rdzv_id: str
    rdzv_backend: str
    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    max_restarts: int
    is_host: bool | None = None  # c10d only: whether this agent hosts the store
    local_addr: str | None = None  # this node's address, when the hostname is ambiguous


def new_rdzv_id(job_name: str) -> str:
    """A fresh rendezvous id: a finished id stays closed for good, so never reuse one."""
    return f"{job_name}-{uuid.uuid4().hex[:12]}"


def node_options(
    spec: JobSpec, run_dir: Path, flags: Mapping[str, object], environ: Mapping[str, str]
) -> NodeOptions:
    """Merge per-node flags (``None`` = unset) and Kubeflow's PET_* variables over the spec.

    Every value is checked here, so a bad flag or variable is one ``SpecError`` naming it.
    """

    def pick(flag: str, pet: str, default: object) -> tuple[object, str]:
        if flags.get(flag) is not None:
            return flags[flag], "--" + flag.replace("_", "-")
        if environ.get(pet):
            return environ[pet], pet
        return default, ""

    nnodes, source = pick("nnodes", "PET_NNODES", f"{spec.nodes.min}:{spec.nodes.max}")
    lo, _, hi = str(nnodes).partition(":")
    min_nodes = _count(lo, source or "nodes.min", 1, "write N or MIN:MAX nodes")
    max_nodes = _count(hi or lo, source or "nodes.max", min_nodes, "write N or MIN:MAX nodes")
    backend, source = pick("rdzv_backend", "PET_RDZV_BACKEND", spec.rendezvous.backend)
    if backend not in _BACKENDS:
        raise SpecError(source or "rendezvous.backend", f"'{backend}' is not one of {list(_BACKENDS)}")
    endpoint, source = pick("rdzv_endpoint", "PET_RDZV_ENDPOINT", spec.rendezvous.endpoint)
    if not endpoint:
        raise SpecError(
            "rendezvous.endpoint", "no endpoint", "pass --rdzv-endpoint HOST:PORT or set it"
        )
    nproc, nproc_source = pick("nproc_per_node", "PET_NPROC_PER_NODE", spec.nproc_per_node)
    restarts, restarts_source = pick("max_restarts", "PET_MAX_RESTARTS", spec.max_restarts)
    return NodeOptions(
        run_dir=run_dir,
        rdzv_endpoint=with_port(str(endpoint), DEFAULT_PORTS[_BACKENDS[str(backend)]],
                                source or "rendezvous.endpoint"),
        rdzv_id=str(pick("rdzv_id", "PET_RDZV_ID", spec.rendezvous.id or "")[0]) or "",
        rdzv_backend=_BACKENDS[str(backend)],
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=_count(nproc, nproc_source or "nproc_per_node", 1),
        max_restarts=_count(restarts, restarts_source or "max_restarts", 0),
        is_host=flags.get("is_host"),  # type: ignore[arg-type]
        local_addr=flags.get("local_addr"),  # type: ignore[arg-type]
    )


def _count(value: object, source: str, minimum: int, hint: str = "") -> int:
    """``value`` as an int >= ``minimum``, or a SpecError naming where it came from."""
    try:
        n = int(str(value))
    except ValueError:
        raise SpecError(source, f"'{value}' is not a whole number", hint) from None
    if n < minimum:
        raise SpecError(source, f"{n} is less than {minimum}", hint)
    return n


def with_port(endpoint: str, default_port: int, source: str = "rendezvous.endpoint") -> str:
    """``HOST[:PORT]`` -> ``HOST:PORT``, like torchrun: a missing port is ``default_port``.

    An IPv6 host is written in brackets (``[::1]:29400``). A port that is not a number in
    1..65535 is a ``SpecError`` naming ``source`` (the flag, variable or field it came from).
    """
    endpoint = endpoint.strip()
    if endpoint.startswith("[") and endpoint.endswith("]"):
        host, port = endpoint, ""
    else:
        host, sep, port = endpoint.rpartition(":")
        host, port = (host, port) if sep else (endpoint, "")
    if not host:
        raise SpecError(source, f"'{endpoint}' has no host", "write HOST[:PORT], e.g. node-0:29400")
    if not port:
        return f"{host}:{default_port}"
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise SpecError(source, f"'{endpoint}': port '{port}' is not a number in 1..65535",
                        f"write HOST:PORT, e.g. {host}:{default_port}")
    return f"{host}:{int(port)}"


def rdzv_configs(spec: JobSpec, opts: NodeOptions) -> dict[str, object]:
    r = spec.rendezvous
    conf: dict[str, object] = {
        "timeout": r.join_timeout,
        "join_timeout": r.join_timeout,
        "last_call_timeout": r.last_call_timeout,
        "close_timeout": r.close_timeout,
        "heartbeat_timeout": r.heartbeat_timeout,
        "keep_alive_interval": r.keep_alive_interval,
        "keep_alive_max_attempt": r.keep_alive_max_attempt,
    }
    if opts.rdzv_backend == "etcd-v2":
        # torch's etcd-v2 backend reads these keys; paths only, never key material.
        conf["protocol"] = r.etcd_protocol
        for key, value in (("ca_cert", r.etcd_ca_cert), ("ssl_cert", r.etcd_cert),
                           ("ssl_cert_key", r.etcd_key)):
            if value:
                conf[key] = value
    if opts.rdzv_backend == "c10d":
        conf["read_timeout"] = max(r.join_timeout, 60)
        if opts.is_host is not None:
            conf["is_host"] = opts.is_host
    return conf


def launch_config(spec: JobSpec, opts: NodeOptions):
    """torchelastic's LaunchConfig for one agent of this job."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    if not opts.rdzv_id:
        raise AssertionError("callers must give every submission its own rendezvous id")
    logs = DefaultLogsSpecs(log_dir=str(opts.run_dir / "logs"), redirects=Std.ALL)
    kwargs = dict(
        min_nodes=opts.min_nodes,
        max_nodes=opts.max_nodes,
        nproc_per_node=opts.nproc_per_node,
        logs_specs=logs,
        run_id=opts.rdzv_id,
        role="trainer",
        rdzv_endpoint=opts.rdzv_endpoint,
        rdzv_backend=opts.rdzv_backend,
        rdzv_configs=rdzv_configs(spec, opts),
        max_restarts=opts.max_restarts,
        monitor_interval=spec.timeouts.monitor_interval,
        start_method="spawn",
        local_addr=opts.local_addr,
        shutdown_timeout=spec.timeouts.shutdown_grace,
    )
    # Older torch (e.g. 2.11 on GPU images) lacks shutdown_timeout; it then reads the
    # TORCH_ELASTIC_SHUTDOWN_TIMEOUT variable, which agent_environ-style callers may set.
    known = {f.name for f in dataclasses.fields(LaunchConfig)}
    if "shutdown_timeout" not in known:
        os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(spec.timeouts.shutdown_grace))
    return LaunchConfig(**{k: v for k, v in kwargs.items() if k in known})


def worker_command(run_dir: Path) -> tuple[str, list[str]]:
    """Entrypoint and args the agent runs per rank: ``python -u -m elastic_harness.runtime.entry
    JOB RUN_DIR``. With ``warm_start`` the agent's zygote runs this same command in a fork that
    already imported torch (``launch.warm``); otherwise torchelastic starts a fresh interpreter."""
    job = run_dir / "job.resolved.yaml"
    return sys.executable, ["-u", "-m", "elastic_harness.runtime.entry", str(job), str(run_dir)]


def agent_environ(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for an agent process.

    Workers get their own TCPStore instead of sharing the rendezvous store: with the shared
    store, restarted gloo groups often failed with ``connectFullMesh ... Connection refused``
    here (pytorch issue 135712). One OpenMP thread per worker unless the user chose.
    """
    env = dict(os.environ if base is None else base)
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env
