"""Real servers for tests, started on OS-picked loopback ports and stopped by pid."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from elastic_harness.simcluster.cluster import free_port, free_ports

# What the ranks of ``rank_context`` import anyway (the forkserver imports it once).
# ``torch._dynamo``: DDP's first construction imports it (~800 modules, 2.5 s on 2 cores).
_RANK_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch.nn.parallel",
                 "torch._dynamo", "elastic_harness.checkpoint.manager", "elastic_harness.runtime.generations",
                 "tests.servers"]


def rank_context():
    """The ``multiprocessing`` context for rank processes a test starts from the pytest
    process: forked from one forkserver that imported ``_RANK_PRELOAD`` once for the session
    (``spawn`` pays ``import torch``, seconds, in every rank), never from pytest itself.

    By the time a test runs, earlier tests of the session have left the pytest process with
    threads: OpenMP's pool after any parallel torch op in the process, library singletons
    (tqdm's monitor, fsspec's loop). A child forked from it inherits their locks but not the
    threads: a rank forked after one in-process ``exp()`` of a large tensor hung in its first
    parallel region until killed. The forkserver is a fresh interpreter, started once, that
    runs no torch op. One preload list for every caller: the server starts with the first
    caller's list and ignores later ones."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_RANK_PRELOAD)
    return ctx


def spawn_ranks(fn, root: Path, nprocs: int = 2) -> list[dict]:
    """Run ``fn(rank, port, root)`` in ``nprocs`` processes (torch.multiprocessing) with a
    free loopback port for their process group; each writes ``root/rank{r}.json``, returned
    in rank order.

    The ranks are forked from the session's forkserver (``rank_context``: ``spawn`` paid
    torch's and DCP's imports in every rank of every fixture, ~4 CPU seconds each). Ranks
    still running when the wait ends early are stopped."""
    import multiprocessing

    import torch.multiprocessing as mp

    from elastic_harness.bench.checkpoint.main import stop_ranks

    rank_context()  # torch's start_processes takes the forkserver with our preload
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


@dataclass(frozen=True)
class EtcdTLS:
    """Files for an etcd on loopback with TLS (``make_tls``): its CA, server and client
    certificates, and a second CA that signed neither."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca: str


def make_tls(directory: Path) -> EtcdTLS:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate signed by
    it, and an unrelated CA, as PEM files in ``directory`` (the ``cryptography`` package)."""
    import datetime as dt
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = dt.datetime.now(dt.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def cert(subject: str, key, issuer: str, signer, *, ca: bool, usage=None, sans=None):
        b = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(name(issuer))
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if usage:
            b = b.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return b.sign(signer, hashes.SHA256())

    def write(stem: str, key, certificate) -> tuple[str, str]:
        key_path, cert_path = directory / f"{stem}.key", directory / f"{stem}.crt"
        key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        return str(cert_path), str(key_path)

    keys = {k: ec.generate_private_key(ec.SECP256R1()) for k in ("ca", "server", "client", "other")}
    ca, _ = write("ca", keys["ca"], cert("test-ca", keys["ca"], "test-ca", keys["ca"], ca=True))
    other, _ = write("other-ca", keys["other"], cert("other-ca", keys["other"], "other-ca", keys["other"], ca=True))
    sans = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    server = write("server", keys["server"], cert("etcd", keys["server"], "test-ca", keys["ca"], ca=False,
                                                  # etcd's gateway dials etcd with it: client use too
                                                  usage=[ExtendedKeyUsageOID.SERVER_AUTH,
                                                         ExtendedKeyUsageOID.CLIENT_AUTH], sans=sans))
    client = write("client", keys["client"], cert("agent", keys["client"], "test-ca", keys["ca"], ca=False,
                                                  usage=[ExtendedKeyUsageOID.CLIENT_AUTH]))
    return EtcdTLS(ca, *server, *client, other)


def _etcd_binary() -> str:
    binary = shutil.which("etcd")
    if binary is None:
        pytest.fail("etcd is not installed: run `bash .ci/setup` (installs Debian's etcd-server)")
    return binary


def _etcd_flags(name: str, data_dir: Path, client_url: str, advertise: str, peer: int, metrics: int,
                v2: bool, gateway: bool, tls: EtcdTLS | None) -> list[str]:
    flags = ["--name", name, "--data-dir", str(data_dir), f"--enable-v2={str(v2).lower()}",
             "--listen-client-urls", client_url, "--advertise-client-urls", advertise,
             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--listen-metrics-urls", f"http://127.0.0.1:{metrics}"]
    if not gateway:  # etcd 3.4 without its v3 JSON gateway: a server that speaks only v2 over HTTP
        flags.append("--enable-grpc-gateway=false")
    if tls is not None:
        flags += ["--cert-file", tls.server_cert, "--key-file", tls.server_key,
                  "--trusted-ca-file", tls.ca, "--client-cert-auth"]
    return flags


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@contextlib.contextmanager
def etcd_server(data_dir: Path, listen_all: bool = False, v2: bool = False, gateway: bool = True,
                tls: EtcdTLS | None = None) -> Iterator[str]:
    """One etcd member (Debian's etcd 3.4), serving its v3 API; ``v2``: also the v2 API
    (what torch's etcd-v2 rendezvous speaks); ``gateway=False``: no v3 over HTTP (with
    ``v2``, an etcd that a v3 client cannot use); ``tls``: https only, client certificates
    signed by ``tls.ca`` required. Yields its client endpoint (``127.0.0.1:PORT``).

    ``listen_all``: also listen on this machine's other addresses (network namespaces reach
    it through their bridge); the endpoint returned is still the loopback one."""
    client, peer, metrics = free_ports(3)
    scheme = "https" if tls else "http"
    listen = f"{scheme}://{'0.0.0.0' if listen_all else '127.0.0.1'}:{client}"
    cmd = [_etcd_binary(), *_etcd_flags("t0", data_dir, listen, f"{scheme}://127.0.0.1:{client}", peer, metrics,
                                        v2, gateway, tls), "--initial-cluster", f"t0=http://127.0.0.1:{peer}"]
    with open(data_dir.parent / "etcd.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: _healthy(f"http://127.0.0.1:{metrics}/health") or proc.poll() is not None,
                   30, "etcd to become healthy")
        assert proc.poll() is None, (data_dir.parent / "etcd.log").read_text()[-2000:]
        yield f"127.0.0.1:{client}"
    finally:
        _stop([proc])


class RestartableEtcd:
    """One etcd member (v3 API only) that a test stops and starts again on the same data
    directory and ports: an etcd restarted, as a cluster's operator restarts it."""

    def __init__(self, data_dir: Path) -> None:
        client, peer, metrics = free_ports(3)
        self.endpoint, self._metrics, self._log = f"127.0.0.1:{client}", metrics, data_dir.parent / "etcd.log"
        url = f"http://127.0.0.1:{client}"
        self._cmd = [_etcd_binary(), *_etcd_flags("t0", data_dir, url, url, peer, metrics, False, True, None),
                     "--initial-cluster", f"t0=http://127.0.0.1:{peer}"]
        self._proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self._log, "ab") as log:
            self._proc = subprocess.Popen(self._cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_until(lambda: _healthy(f"http://127.0.0.1:{self._metrics}/health") or self._proc.poll() is not None,
                   30, "etcd to become healthy")
        assert self._proc.poll() is None, self._log.read_text()[-2000:]

    def stop(self) -> None:
        if self._proc is not None:
            _stop([self._proc])


@contextlib.contextmanager
def restartable_etcd(data_dir: Path) -> Iterator[RestartableEtcd]:
    etcd = RestartableEtcd(data_dir)
    try:
        etcd.start()
        yield etcd
    finally:
        etcd.stop()


@contextlib.contextmanager
def etcd_cluster(root: Path, members: int = 3, v2: bool = False) -> Iterator[list[tuple[str, subprocess.Popen]]]:
    """``members`` etcd members forming one cluster on loopback: [(client endpoint, process)]."""
    flat = free_ports(3 * members)
    ports = [tuple(flat[i:i + 3]) for i in range(0, len(flat), 3)]
    initial = ",".join(f"m{i}=http://127.0.0.1:{peer}" for i, (_, peer, _) in enumerate(ports))
    procs = []
    try:
        for i, (client, peer, metrics) in enumerate(ports):
            url = f"http://127.0.0.1:{client}"
            cmd = [_etcd_binary(), *_etcd_flags(f"m{i}", root / f"m{i}", url, url, peer, metrics, v2, True, None),
                   "--initial-cluster", initial, "--initial-cluster-state", "new",
                   "--initial-cluster-token", root.name]
            with open(root / f"m{i}.log", "wb") as log:
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        for _, _, metrics in ports:
            wait_until(lambda m=metrics: _healthy(f"http://127.0.0.1:{m}/health"), 60,
                       f"etcd member with metrics port {metrics} to become healthy")
        yield [(f"127.0.0.1:{client}", p) for (client, _, _), p in zip(ports, procs, strict=True)]
    finally:
        _stop(procs)


def etcd_enable_auth(endpoint: str, user: str, password: str, prefix: bytes = b"/torch/elastic/") -> None:
    """Turn on etcd's authentication: a root user, and ``user`` with read and write on
    ``prefix`` only (through the v3 gateway, as ``etcdctl`` would)."""
    import base64

    def post(path: str, body: dict) -> None:
        req = urllib.request.Request(f"http://{endpoint}/v3/{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200, (path, r.read())

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    end = prefix[:-1] + bytes([prefix[-1] + 1])
    post("auth/role/add", {"name": "root"})
    post("auth/user/add", {"name": "root", "password": "root-" + password})
    post("auth/user/grant", {"user": "root", "role": "root"})
    post("auth/role/add", {"name": "job"})
    post("auth/role/grant", {"name": "job", "perm": {"permType": "READWRITE", "key": b64(prefix),
                                                       "range_end": b64(end)}})
    post("auth/user/add", {"name": user, "password": password})
    post("auth/user/grant", {"user": user, "role": "job"})
    post("auth/enable", {})


@contextlib.contextmanager
def tmpfs(path: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at ``path`` (made here) with ``options`` (``ro``, ``size=64k``: a
    read-only or a small disk that root cannot write past), unmounted after; the test is
    skipped, saying why, where mounting is not allowed (not root / no CAP_SYS_ADMIN)."""
    path.mkdir(exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                             capture_output=True, text=True, timeout=30)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], capture_output=True, timeout=30)
