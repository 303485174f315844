"""``elastic-harness bench rendezvous``: a rendezvous round on etcd's v3 API vs its v2 API.

One etcd (the ``etcd`` on PATH, started here on loopback with both APIs: ``--enable-v2``)
serves both backends side by side: ``etcd-v3`` (ours, ``rendezvous.etcd_v3``) and ``etcd-v2``
(torch's, through python-etcd: the ``etcd`` extra). For each of ``--repeats`` rendezvous
ids, alternating which backend goes first, ``--nodes`` handlers (the agent's own:
``rendezvous.handler.create_handler``, sealed state, workers' store private as the agent
runs it) form a first round, then ``--rounds`` re-rendezvous rounds: every handler calls
``next_rendezvous`` at once, as after a worker failure, and the round's time is the
slowest handler's. The first round is not timed: torch skews its joins by a random
0-0.3 s.

It prints JSON: per backend the mean and median round (and range), the time inside the
backend's ``get_state``/``set_state`` per round and how many calls a round made; the ratios
v3 / v2 of the mean round (the goal's figure: ``summarize`` says why not the median), the
median round and the backend time. Goal: v3 no slower (round ratio <= 1).

What a round holds besides the backend: waiting handlers read the state every
``rendezvous.rules.POLL_S`` (0.25 s), the same for both, so the round ratio leans
towards 1; the backend time is the part that differs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import statistics
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from elastic_harness.bench import check_out, scratch_dir
from elastic_harness.errors import HarnessError

BACKENDS = ("etcd-v2", "etcd-v3")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rendezvous", help="a rendezvous round on etcd's v3 vs v2 API, one local etcd (JSON)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2, help="handlers per rendezvous (default 2)")
    p.add_argument("--repeats", type=int, default=5, help="rendezvous ids per backend (default 5)")
    p.add_argument("--rounds", type=int, default=6, help="timed re-rendezvous rounds per id (default 6)")
    p.add_argument("--out", help="also write the JSON here")
    p.set_defaults(func=cmd_rendezvous)


def cmd_rendezvous(args: argparse.Namespace) -> int:
    if min(args.nodes, args.repeats, args.rounds) < 1:
        raise HarnessError("--nodes, --repeats and --rounds must be >= 1")
    check_out(args.out)
    from elastic_harness import deps

    deps.require_extra("etcd")  # torch's etcd-v2 backend, the one compared with
    scratch = scratch_dir("eh-bench-rdzv-", None)
    old = os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # as the agent runs (launch.config)
    try:
        with local_etcd(scratch) as (endpoint, version):
            samples = {b: {"round": [], "backend": [], "calls": []} for b in BACKENDS}
            for repeat in range(args.repeats):
                order = BACKENDS if repeat % 2 == 0 else BACKENDS[::-1]
                for backend in order:
                    measure(backend, endpoint, f"bench-{repeat}-{backend}", args, samples[backend])
    finally:
        if old is None:
            os.environ.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
        else:
            os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = old
        shutil.rmtree(scratch, ignore_errors=True)
    out = summarize(samples, args, version)
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


def summarize(samples: dict, args: argparse.Namespace, version: str) -> dict:
    """Pure: the JSON from each backend's per-round samples (seconds, calls).

    The goal compares mean rounds: a round ends at a waiting handler's poll, so round times
    cluster at one poll (~0.27 s) and two (~0.52 s), and a median flips between them with a
    few rounds more or less in either cluster; the mean weighs them as they happened."""
    def med(backend: str, key: str) -> float:
        return statistics.median(samples[backend][key])

    def mean(backend: str) -> float:
        return statistics.fmean(samples[backend]["round"])

    per = {b: {"round_mean_s": round(mean(b), 4), "round_median_s": round(med(b, "round"), 4),
               "round_range_s": [round(min(samples[b]["round"]), 4), round(max(samples[b]["round"]), 4)],
               "backend_s_per_round": round(med(b, "backend"), 5),
               "backend_calls_per_round": med(b, "calls")} for b in BACKENDS}
    ratio = mean("etcd-v3") / mean("etcd-v2")
    return {"bench": "rendezvous", "etcd": version, "nodes": args.nodes, "repeats": args.repeats,
            "rounds": args.rounds, **per,
            "round_ratio_v3_over_v2": round(ratio, 3),
            "round_median_ratio_v3_over_v2": round(med("etcd-v3", "round") / med("etcd-v2", "round"), 3),
            "backend_ratio_v3_over_v2": round(med("etcd-v3", "backend") / med("etcd-v2", "backend"), 3),
            "goal": "etcd-v3 round no slower than etcd-v2 (round_ratio_v3_over_v2, of the means, <= 1)",
            "goal_met": ratio <= 1.0}


def measure(backend: str, endpoint: str, run_id: str, args: argparse.Namespace, into: dict) -> None:
    """One rendezvous id: a first round, then ``args.rounds`` timed ones (module doc)."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from elastic_harness.rendezvous.handler import create_handler

    key = secrets.token_bytes(32)
    conf = dict(join_timeout=60, last_call_timeout=1, start_last_call_timeout=5, close_timeout=10,
                heartbeat_timeout=5, keep_alive_interval=1, keep_alive_max_attempt=3, read_timeout=30)
    handlers = [create_handler(RendezvousParameters(backend, endpoint, run_id, args.nodes, args.nodes, **conf),
                               key=key) for _ in range(args.nodes)]
    clocks = [_time_backend(h) for h in handlers]
    try:
        _round(handlers)
        for _ in range(args.rounds):
            for c in clocks:
                c.update(seconds=0.0, calls=0)
            into["round"].append(_round(handlers))
            into["backend"].append(max(c["seconds"] for c in clocks))
            into["calls"].append(sum(c["calls"] for c in clocks) / len(clocks))
    finally:
        for h in handlers:
            h.shutdown()


def _round(handlers: list) -> float:
    """Every handler joins the next round at once; seconds until the last one is in."""
    errors: list[BaseException] = []
    start = threading.Barrier(len(handlers) + 1)

    def join(h) -> None:
        try:
            start.wait()
            h.next_rendezvous()
        except BaseException as e:  # noqa: BLE001 - raised below
            errors.append(e)

    threads = [threading.Thread(target=join, args=(h,)) for h in handlers]
    for t in threads:
        t.start()
    start.wait()
    began = time.perf_counter()
    for t in threads:
        t.join(120)
    if errors or any(t.is_alive() for t in threads):
        raise HarnessError(f"a bench rendezvous failed: {errors[:1] or 'timed out'}")
    return time.perf_counter() - began


def _time_backend(handler) -> dict:
    """Count the seconds and calls inside this handler's backend (its ``get_state`` and
    ``set_state``, whichever thread calls them)."""
    from elastic_harness.torchcompat.rdzv import state_backend

    backend = state_backend(handler)
    if backend is None:
        raise HarnessError("this torch keeps its rendezvous backend out of reach (torchcompat: rdzv-state)",
                           "run bench rendezvous with a torch that has it (docs/torch-versions.md)")
    clock = {"seconds": 0.0, "calls": 0}
    lock = threading.Lock()

    def timed(fn):
        def wrapper(*a, **kw):
            began = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                with lock:
                    clock["seconds"] += time.perf_counter() - began
                    clock["calls"] += 1
        return wrapper

    backend.get_state, backend.set_state = timed(backend.get_state), timed(backend.set_state)
    return clock


@contextlib.contextmanager
def local_etcd(scratch: Path) -> Iterator[tuple[str, str]]:
    """An etcd on loopback serving both APIs, data in ``scratch``; (endpoint, version)."""
    from elastic_harness.simcluster.cluster import free_ports

    binary = shutil.which("etcd")
    if binary is None:
        raise HarnessError("bench rendezvous needs the etcd server on PATH",
                           "install it (Debian: apt-get install etcd-server), any 3.4 or 3.5")
    client, peer, metrics = free_ports(3)
    url, purl = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    cmd = [binary, "--name", "bench", "--data-dir", str(scratch / "etcd"), "--enable-v2=true",
           "--listen-client-urls", url, "--advertise-client-urls", url, "--listen-peer-urls", purl,
           "--initial-advertise-peer-urls", purl, "--initial-cluster", f"bench={purl}",
           "--listen-metrics-urls", f"http://127.0.0.1:{metrics}"]
    with open(scratch / "etcd.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        version = _wait_ready(url, f"http://127.0.0.1:{metrics}/health", proc)
        yield f"127.0.0.1:{client}", version
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_ready(url: str, health: str, proc: subprocess.Popen, timeout_s: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(health, timeout=1) as r:
                if r.status == 200:
                    with urllib.request.urlopen(f"{url}/version", timeout=1) as v:
                        return json.loads(v.read())["etcdserver"]
        except OSError:
            pass
        time.sleep(0.1)
    raise HarnessError("the bench's etcd did not start", f"see etcd's own log (exit {proc.poll()})")
