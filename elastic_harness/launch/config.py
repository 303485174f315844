"""Spec + per-node options -> torchelastic's ``LaunchConfig``.

The only module that knows torchrun's knobs: rendezvous configuration keys, the agent's
monitor interval and shutdown grace, log redirection, and how a worker is started. It starts
no processes and opens no connections, but not everything here is pure: ``new_rdzv_id`` is
random, ``agent_environ`` reads this process's environment, and ``launch_config`` creates the
log directory (torchelastic's ``DefaultLogsSpecs`` does) and, on torch without a shutdown
timeout field, sets ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` in this process's environment.
``rdzv_configs`` is pure, and so is ``node_options`` but for what it is handed to call.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from elastic_harness import jobkey, runfiles
from elastic_harness.errors import SpecError
from elastic_harness.launch import slurm_env
from elastic_harness.spec import JobSpec, backends

# The standalone rendezvous (``--standalone``): one node, its own store.
_STANDALONE = backends.BY_NAME["c10d"]


@dataclass(frozen=True)
class NodeOptions:
    """What one agent needs beyond the spec (``node_options`` says where each comes from)."""

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
    rdzv_conf: dict = dataclasses.field(default_factory=dict)  # --rdzv-conf: over rdzv_configs
    key_file: Path | None = None  # the job's key (``jobkey``); None: ``run_dir/job.key``


def new_rdzv_id(job_name: str) -> str:
    """A fresh rendezvous id: a finished id stays closed for good, so never reuse one."""
    return f"{job_name}-{uuid.uuid4().hex[:12]}"


# torchrun's --rdzv-conf keys that hold whole seconds or counts (others pass through).
_CONF_COUNTS = ("timeout", "join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout",
                "keep_alive_interval", "keep_alive_max_attempt", "read_timeout")
_NPROC_WORDS = ("gpu", "cpu", "auto")


def device_count(kind: str) -> int:
    """CPUs or GPUs on this machine (``--nproc-per-node cpu|gpu|auto``); imports torch for GPUs."""
    if kind == "cpu":
        return os.cpu_count() or 1
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def node_options(
    spec: JobSpec, run_dir: Path, flags: Mapping[str, object], environ: Mapping[str, str],
    devices: Callable[[str], int] = device_count, pick_port: Callable[[], int] | None = None,
) -> NodeOptions:
    """Merge per-node flags (``None`` = unset), ``PET_*`` variables (torchrun's, which
    Kubeflow's operator sets), Slurm's variables (``slurm_env``) and the spec, in that order.

    torchrun's language: ``nnodes`` N or MIN:MAX; ``nproc_per_node`` N, ``cpu`` (CPU
    count), ``gpu`` (GPU count) or ``auto`` (GPUs if any, else CPUs); ``rdzv_conf``
    ``k=v,...`` over the spec's rendezvous settings; ``standalone`` (a c10d store on this
    machine at a free port from ``pick_port``, a fresh id). Every value is checked here, so
    a bad flag or variable is one ``SpecError`` naming it. Pure but for ``devices`` (called
    only for the words) and ``pick_port`` / a fresh id (only with ``standalone``).
    """
    pick = _Picker(flags, environ)
    nnodes, source = pick("nnodes", f"{spec.nodes.min}:{spec.nodes.max}")
    lo, _, hi = str(nnodes).partition(":")
    min_nodes = _count(lo, source or "nodes.min", 1, "write N or MIN:MAX nodes")
    max_nodes = _count(hi or lo, source or "nodes.max", min_nodes, "write N or MIN:MAX nodes")
    nproc, nproc_source = pick("nproc_per_node", spec.nproc_per_node)
    nproc = _nproc(nproc, nproc_source or "nproc_per_node", devices)
    _enough_batch(spec, max_nodes * nproc, nproc_source or source)
    restarts, restarts_source = pick("max_restarts", spec.max_restarts)
    rdzv = _rendezvous(spec, pick, environ, pick_port)
    conf_text, conf_source = pick("rdzv_conf", "")
    return NodeOptions(
        run_dir=run_dir, min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=nproc,
        max_restarts=_count(restarts, restarts_source or "max_restarts", 0),
        # --standalone is this machine alone: its stores and gloo stay on loopback.
        local_addr=pick("local_addr", "127.0.0.1" if pick.flag("standalone") else None)[0],  # type: ignore[arg-type]
        rdzv_conf=parse_rdzv_conf(str(conf_text or ""), conf_source),
        key_file=jobkey.key_path(run_dir, environ), **rdzv,
    )


class _Picker:
    """A value and where it came from: the flag, else its PET_* variable, else ``default``."""

    def __init__(self, flags: Mapping[str, object], environ: Mapping[str, str]) -> None:
        self.flags, self.environ = flags, environ

    def __call__(self, name: str, default: object) -> tuple[object, str]:
        if self.flags.get(name) is not None:
            return self.flags[name], "--" + name.replace("_", "-")
        pet = "PET_" + name.upper()
        if self.environ.get(pet):
            return self.environ[pet], pet
        return default, ""

    def flag(self, name: str) -> bool:
        """A torchrun switch (``--standalone``): set by the flag or a PET_* value not 0/false."""
        value, _ = self(name, False)
        return value is True or str(value).lower() not in ("", "0", "false", "no")


def _rendezvous(spec: JobSpec, pick: _Picker, environ: Mapping[str, str],
                pick_port: Callable[[], int] | None) -> dict:
    """Backend, endpoint, id and store host; ``standalone`` decides all four."""
    if pick.flag("standalone"):
        port = pick_port() if pick_port is not None else _STANDALONE.port
        return {"rdzv_backend": _STANDALONE.torch_name, "rdzv_endpoint": f"127.0.0.1:{port}",
                "rdzv_id": new_rdzv_id(spec.name), "is_host": True}
    backend, source = pick("rdzv_backend", spec.rendezvous.backend)
    if backend not in backends.BY_NAME:
        raise SpecError(source or "rendezvous.backend", f"'{backend}' is not one of {list(backends.NAMES)}")
    row = backends.BY_NAME[str(backend)]
    backend = row.torch_name
    slurm_host = slurm_env.endpoint_host(environ) if row.hosts_store else ""
    endpoint, source = pick("rdzv_endpoint", spec.rendezvous.endpoint or slurm_host)
    if not endpoint:
        raise SpecError(
            "rendezvous.endpoint", "no endpoint", "pass --rdzv-endpoint HOST:PORT or set it"
        )
    endpoint = endpoints_with_ports(str(endpoint), backend, source or "rendezvous.endpoint")
    is_host = pick.flags.get("is_host")
    if is_host is None and row.hosts_store:
        is_host = slurm_env.is_store_host(environ, endpoint)
    rdzv_id = pick("rdzv_id", spec.rendezvous.id or slurm_env.rdzv_id(environ))[0]
    return {"rdzv_backend": backend, "rdzv_endpoint": endpoint, "rdzv_id": str(rdzv_id or ""),
            "is_host": is_host}


def _nproc(value: object, source: str, devices: Callable[[str], int]) -> int:
    word = str(value).strip().lower()
    if word not in _NPROC_WORDS:
        return _count(value, source, 1, "write a number, or gpu, cpu or auto")
    gpus = devices("gpu") if word in ("gpu", "auto") else 0
    if word == "gpu" and gpus == 0:
        raise SpecError(source, "'gpu' asked for one worker per GPU, but no GPU is visible",
                        "use a number, cpu or auto")
    return gpus if gpus else devices("cpu")


def _enough_batch(spec: JobSpec, most_ranks: int, source: str) -> None:
    """The spec checks its own node range; a flag or variable can make more ranks than that."""
    if spec.train.global_batch_size < most_ranks:
        raise SpecError(source or "nproc_per_node",
                        f"{most_ranks} ranks at most, but train.global_batch_size is "
                        f"{spec.train.global_batch_size}: some ranks would get no samples",
                        f"use fewer ranks, or --set train.global_batch_size={most_ranks}")


def parse_rdzv_conf(text: str, source: str = "--rdzv-conf") -> dict[str, str]:
    """torchrun's ``k=v,k=v``; the counts torch reads as integers are checked here."""
    conf: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SpecError(source, f"'{item}' is not KEY=VALUE", "write e.g. join_timeout=900,read_timeout=120")
        key, value = key.strip(), value.strip()
        if key in _CONF_COUNTS and not (value.isdigit() and int(value) > 0):
            raise SpecError(source, f"{key}='{value}' is not a whole number of seconds or times above 0")
        conf[key] = value
    return conf


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


def endpoints_with_ports(text: str, backend: str, source: str) -> str:
    """``with_port`` for each of an etcd's comma-separated members (the client fails over
    between them); c10d has one store, so one endpoint."""
    row = backends.BY_TORCH_NAME[backend]
    parts = [p for p in (p.strip() for p in text.split(",")) if p]
    if len(parts) > 1 and row.hosts_store:
        raise SpecError(source, f"'{text}' names {len(parts)} endpoints, but the {row.name} store is one",
                        "name the agent that hosts the store, or use rendezvous.backend: etcd")
    return ",".join(with_port(p, row.port, source) for p in parts or [text])


def rdzv_configs(spec: JobSpec, opts: NodeOptions) -> dict[str, object]:
    r = spec.rendezvous
    conf: dict[str, object] = {
        "timeout": r.join_timeout,
        "join_timeout": r.join_timeout,
        "start_last_call_timeout": r.start_last_call_timeout,  # read by rendezvous.handler
        "last_call_timeout": r.last_call_timeout,
        "close_timeout": r.close_timeout,
        "heartbeat_timeout": r.heartbeat_timeout,
        "keep_alive_interval": r.keep_alive_interval,
        "keep_alive_max_attempt": r.keep_alive_max_attempt,
    }
    row = backends.BY_TORCH_NAME.get(opts.rdzv_backend)
    for key, name, always in row.settings if row else ():  # the backend's own (spec/backends.py)
        if always or getattr(r, name):
            conf[key] = getattr(r, name)
    if row and row.hosts_store:
        conf["read_timeout"] = max(r.join_timeout, 60)
        if opts.is_host is not None:
            conf["is_host"] = opts.is_host
    conf = {**conf, **opts.rdzv_conf}  # --rdzv-conf, as torchrun: the user's word is last
    # The file holding the key that seals the rendezvous state (a path, never key material).
    conf["key_file"] = str(opts.key_file or Path(opts.run_dir) / jobkey.KEY_FILE)
    return conf


def launch_config(spec: JobSpec, opts: NodeOptions):
    """torchelastic's LaunchConfig for one agent of this job."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    if not opts.rdzv_id:
        raise AssertionError("callers must give every submission its own rendezvous id")
    logs = DefaultLogsSpecs(log_dir=str(opts.run_dir / runfiles.LOGS), redirects=Std.ALL)
    # Only fields every supported torch has (2.11's has no shutdown_timeout): the shutdown
    # grace goes to the agent itself (``Launch(shutdown_grace=)``, torchcompat.agent).
    return LaunchConfig(
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
    )


def worker_command(run_dir: Path) -> tuple[str, list[str]]:
    """Entrypoint and args the agent runs per rank: ``python -u -m elastic_harness.runtime.entry
    JOB RUN_DIR``. With ``warm_start`` the agent's zygote runs this same command in a fork that
    already imported torch (``agent.warm``); otherwise torchelastic starts a fresh interpreter."""
    job = run_dir / runfiles.RESOLVED_SPEC
    return sys.executable, ["-u", "-m", "elastic_harness.runtime.entry", str(job), str(run_dir)]


# glibc malloc thresholds for the zygote and the workers (``worker_malloc_environ``).
MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for its dynamic threshold
TRIM_THRESHOLD = 128 << 20


def worker_malloc_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """Pure: fixed glibc malloc thresholds for the processes the agent starts, unless the
    user chose any ``MALLOC_*`` setting.

    glibc raises its mmap threshold (and trim threshold) only when a large mmapped block
    is freed. In workers forked from the zygote it stayed low: every step's large tensors
    came from fresh mappings, or the heap was trimmed and grown again (``brk``), ~1500
    page faults and ~4 ms more kernel time per step than a plain torchrun worker on the
    bench's MLP (``bench throughput``; with these: 3-300 faults, the same kernel time as
    plain). Blocks under 32 MB then come from the heap, and up to 128 MB of freed heap is
    kept for reuse instead of returned to the kernel.
    """
    if any(k.startswith("MALLOC_") for k in environ):
        return {}
    return {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}


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
