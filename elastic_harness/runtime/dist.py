"""Process groups for one worker generation: init with explicit values, always a timeout.

``init`` creates the default group (gloo on CPU, gloo+NCCL on GPU) unless the user's script
already did, plus a separate gloo group for checkpoint collectives: async saves run
collectives from a background thread, which must never interleave with training's.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import socket
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastic_harness.errors import HarnessError
from elastic_harness.launch.env import WorkerEnv
from elastic_harness.listen import listener


@dataclass
class Groups:
    device: torch.device
    backend: str
    ckpt: Any  # a separate gloo group: async checkpoint collectives never interleave with training's
    owned: bool  # we created the default group (and so destroy it)


def choose_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise HarnessError("device: cuda requested but no GPU is visible", "set device: auto or cpu")
        if local_rank >= torch.cuda.device_count():
            raise HarnessError(
                f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible)",
                "lower nproc_per_node to the GPUs per node, or set device: cpu",
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init(env: WorkerEnv, device_request: str, timeout_s: int, live: Any = None, forming: Any = None) -> Groups:
    """Join (or create) the default group and create the checkpoint group.

    ``live``: this process's ``runtime.generations.Generations`` when a fault may be recovered
    in place (``runtime.inplace``): every group is then a live group, and a training function
    run again in this process (a rerun) finds the groups its re-formation made (``current``);
    ``forming``: a context the groups are made in (``Recovery.forming``)."""
    global _GROUPS
    if live is not None and _GROUPS is not None and dist.is_initialized():
        return _GROUPS
    device = choose_device(device_request, env.local_rank)
    timeout = dt.timedelta(seconds=timeout_s)
    owned = not dist.is_initialized()
    if owned and live is not None:
        with forming if forming is not None else contextlib.nullcontext():
            _GROUPS = _init_live(env, device, timeout, live)
        return _GROUPS
    if owned:
        # On GPU keep a CPU backend too: async checkpoint staging needs CPU collectives.
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, store=_store(env, timeout), rank=env.rank,
                                world_size=env.world_size, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
    elif dist.get_world_size() != env.world_size:
        raise HarnessError(
            f"the script's process group has {dist.get_world_size()} ranks, the launcher "
            f"started {env.world_size}",
            "initialise it from the launcher's environment (init_method='env://'), or let "
            "elastic_harness.init() do it",
        )
    backend = str(dist.get_backend())
    ckpt = dist.new_group(backend="gloo", timeout=timeout)
    return Groups(device=device, backend=backend, ckpt=ckpt, owned=owned)


_GROUPS: Groups | None = None  # a live process's groups, kept across its generations


def _init_live(env: WorkerEnv, device: torch.device, timeout: dt.timedelta, live: Any) -> Groups:
    """The default group and the checkpoint group as live groups (``runtime.generations``),
    on this generation's store under its tag; the checkpoint group raises on a failure."""
    from elastic_harness.runtime.generations import tag_of
    from elastic_harness.torchcompat.groups import BACKEND

    store = generation_store(env, timeout.total_seconds())
    live.cuda = device if device.type == "cuda" else None
    live.begin(store, tag_of(env.master_port))
    dist.init_process_group(backend=BACKEND, store=store, rank=env.rank, world_size=env.world_size,
                            timeout=timeout, device_id=device if device.type == "cuda" else None)
    with live.raising():
        ckpt = dist.new_group(backend=BACKEND, timeout=timeout)
    return Groups(device=device, backend=BACKEND, ckpt=ckpt, owned=True)


def current() -> Groups | None:
    """A live process's groups (``init`` with ``live``), or None."""
    return _GROUPS


def generation_store(env: WorkerEnv, timeout_s: float) -> dist.Store:
    """The store where a generation's ranks meet (``_store``), for a survivor re-forming too."""
    return _store(env, dt.timedelta(seconds=timeout_s))


def _store(env: WorkerEnv, timeout: dt.timedelta) -> dist.Store:
    """Where ranks meet: rank 0's own store, or the agent's shared one (plain torchrun).

    torchrun shares its rendezvous store with workers by default, and that store outlives
    worker generations: a restarted gloo group then finds the previous generation's
    addresses under the same keys and fails with ``connectFullMesh ... Connection refused``
    (pytorch issue 135712). On one node every rank has the same restart count, so a
    per-attempt key prefix keeps generations apart. Several nodes under plain torchrun
    need ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (our agent always sets it).
    """
    if not env.launched:  # `python script.py`: a world of one, no network
        return dist.HashStore()
    if env.agent_store:
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False,
                              timeout=timeout)
        if env.local_world_size == env.world_size:
            return dist.PrefixStore(f"elastic_harness/attempt-{env.restart_count}", store)
        return store
    if env.rank != 0:
        wait_for_listener(env.master_addr, env.master_port, timeout.total_seconds())
        return dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                             is_master=False, timeout=timeout, multi_tenant=True)
    if env.master_port in _SERVED:  # a script's: served before the script ran (``serve_for_script``)
        return _SERVED[env.master_port]
    # Rank 0 serves on MASTER_ADDR only (the node's --local-addr, 127.0.0.1 in a local run),
    # not on every interface as TCPStore would: see ``elastic_harness.listen``.
    sock = listener(env.master_addr, env.master_port)
    # Kept: a survivor re-formed in place serves this store before its script runs again,
    # whose ``serve_for_script`` then finds it instead of binding the port a second time.
    _SERVED[env.master_port] = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=True,
                                             timeout=timeout, multi_tenant=True, master_listen_fd=sock.detach())
    return _SERVED[env.master_port]


_SERVED: dict[int, dist.TCPStore] = {}  # port -> rank 0's store, kept for the process's life


def serve_for_script(env: WorkerEnv, timeout_s: float) -> None:
    """Rank 0 of a script our agent started: serve this generation's store on MASTER_ADDR
    before the script runs. A plain torchrun-style script calls
    ``init_process_group`` itself, and torch's ``env://`` then makes rank 0's ``TCPStore``
    listen on every interface; but it asks for a multi-tenant store, which reuses a server
    this process already runs on that port. So the server is this one, bound as the
    harness's own (``elastic_harness.listen``: 127.0.0.1 in a local run), and the script's
    ``init_process_group`` joins it unchanged. A script on the harness's API gets the same
    store from ``init`` (``_store``). Not for the agent's shared store (torchrun's default,
    where every rank is a client) nor for ranks other than 0. Limit: an ``init_method`` of
    the script's own (another port, ``tcp://``, ``file://``) is the script's business."""
    if not env.launched or env.agent_store or env.rank != 0 or env.master_port in _SERVED:
        return
    sock = listener(env.master_addr, env.master_port)
    _SERVED[env.master_port] = dist.TCPStore(
        env.master_addr, env.master_port, env.world_size, is_master=True, wait_for_workers=False,
        timeout=dt.timedelta(seconds=timeout_s), multi_tenant=True, master_listen_fd=sock.detach())


def wait_for_listener(addr: str, port: int, timeout_s: float, poll_s: float = 0.005) -> bool:
    """Until something accepts connections at ``addr:port`` (rank 0's store), or ``timeout_s``.

    Every rank of a new generation starts at once, and rank 0 creates the store only once it
    got that far. A client that comes first is refused, and torch's TCPStore client then
    backs off 250-750 ms before it retries (0.5 s of a 0.3 s restart, now and then); a bare
    connect every ``poll_s`` costs nothing by comparison. False on timeout: TCPStore then
    reports the failure as it would have."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((addr, port), timeout=max(0.01, min(1.0, timeout_s))) as sock:
                # A connect to a free local port can pick that port as its own source and
                # connect to itself (TCP simultaneous open): nobody listens then.
                if sock.getsockname() != sock.getpeername():
                    return True
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


def destroy(groups: Groups | None = None) -> None:
    global _GROUPS
    if dist.is_initialized() and (groups is None or groups.owned):
        dist.destroy_process_group()
        _GROUPS = None
