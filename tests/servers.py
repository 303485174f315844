"""Real servers for tests, started on OS-picked loopback ports and stopped by pid."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What every rank of ``spawn_ranks`` imports anyway (the forkserver imports it once).
_RANK_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint",
                 "elastic_harness.checkpoint.manager", "tests.servers"]


def spawn_ranks(fn, root: Path, nprocs: int = 2) -> list[dict]:
    """Run ``fn(rank, port, root)`` in ``nprocs`` processes (torch.multiprocessing) with a
    free loopback port for their process group; each writes ``root/rank{r}.json``, returned
    in rank order.

    The ranks are forked from one forkserver that imported torch and DCP once for the whole
    test session (``spawn`` paid those imports in every rank of every fixture: ~4 CPU
    seconds each); the server forks from a clean single-threaded process, not from pytest,
    and exits with it. Ranks still running when the wait ends early are stopped."""
    import multiprocessing

    import torch.multiprocessing as mp

    from elastic_harness.bench.checkpoint import stop_ranks

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_RANK_PRELOAD)
    try:
        ranks = mp.start_processes(fn, args=(free_port(), str(root)), nprocs=nprocs, join=False,
                                   start_method="forkserver")
        while not ranks.join():
            pass
    except BaseException:  # a failed rank (torch stopped the others) or Ctrl-C, maybe while the
        # ranks were still being started: multiprocessing would join them at pytest's exit
        stop_ranks(multiprocessing.active_children())
        raise
    return [json.loads((root / f"rank{r}.json").read_text()) for r in range(nprocs)]


def wait_until(check, timeout: float, what: str) -> None:
    """Poll ``check()`` until it is truthy; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout}s waiting for {what}")


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def etcd_server(data_dir: Path, listen_all: bool = False) -> Iterator[str]:
    """One etcd member with the v2 API (what torch's etcd-v2 rendezvous speaks).

    ``listen_all``: also listen on this machine's other addresses (network namespaces reach
    it through their bridge); the endpoint returned is still the loopback one."""
    binary = shutil.which("etcd")
    if binary is None:
        pytest.fail("etcd is not installed: run `bash .ci/setup` (installs Debian's etcd-server)")
    client, peer = free_port(), free_port()
    cmd = [
        binary, "--name", "t0", "--data-dir", str(data_dir), "--enable-v2",
        "--listen-client-urls", f"http://{'0.0.0.0' if listen_all else '127.0.0.1'}:{client}",
        "--advertise-client-urls", f"http://127.0.0.1:{client}",
        "--listen-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-cluster", f"t0=http://127.0.0.1:{peer}",
    ]
    with open(data_dir.parent / "etcd.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: _healthy(f"http://127.0.0.1:{client}/health") or proc.poll() is not None,
                   30, "etcd to become healthy")
        assert proc.poll() is None, (data_dir.parent / "etcd.log").read_text()[-2000:]
        yield f"127.0.0.1:{client}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def etcd_cluster(root: Path, members: int = 3) -> Iterator[list[tuple[str, subprocess.Popen]]]:
    """``members`` etcd members forming one cluster on loopback: [(client endpoint, process)]."""
    binary = shutil.which("etcd")
    if binary is None:
        pytest.fail("etcd is not installed: run `bash .ci/setup` (installs Debian's etcd-server)")
    ports = [(free_port(), free_port()) for _ in range(members)]
    initial = ",".join(f"m{i}=http://127.0.0.1:{peer}" for i, (_, peer) in enumerate(ports))
    procs = []
    try:
        for i, (client, peer) in enumerate(ports):
            cmd = [binary, "--name", f"m{i}", "--data-dir", str(root / f"m{i}"), "--enable-v2",
                   "--listen-client-urls", f"http://127.0.0.1:{client}",
                   "--advertise-client-urls", f"http://127.0.0.1:{client}",
                   "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                   "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                   "--initial-cluster", initial, "--initial-cluster-state", "new",
                   "--initial-cluster-token", root.name]
            with open(root / f"m{i}.log", "wb") as log:
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        for client, _ in ports:
            wait_until(lambda c=client: _healthy(f"http://127.0.0.1:{c}/health"), 60,
                       f"etcd member on port {client} to become healthy")
        yield [(f"127.0.0.1:{client}", p) for (client, _), p in zip(ports, procs, strict=True)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
