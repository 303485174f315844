"""``elastic-harness bench rendezvous-scale``: messages and bytes the rendezvous costs per round.

Many light agents: ``N`` of our rendezvous handlers (``rendezvous.handler``,
torch's dynamic rendezvous with the state sealed under a job key), each with its own client
connection, in threads of this process, against a real c10d ``TCPStore``; no workers. Every
store call of every handler is counted at its client (one call is one request and one
reply), with the bytes both ways (keys, the compare-and-set's expected and desired values,
the reply). Per ``N``:

- ``form``: round 0, all ``N`` joining at once, until each has its rank;
- ``keep_alive``: ``--idle`` seconds of a formed group doing nothing: keep-alives (each a
  compare-and-set of the whole state) and the state reads a running agent makes (one every
  ``POLL_S``, as its monitor loop asks for waiting nodes);
- ``node_loss``: node ``N-1`` stops without a word; the survivors, their agents having
  judged it gone (``condemn``, as ``rendezvous.verdict`` does), leave the round and form the
  next one;
- the state's size (sealed, base64, as stored) and compare-and-set calls that lost the race.

``extrapolate`` fits each figure's growth over the ``N`` measured (``a N + b N^2``; the
state's size ``c + a N``) and says what it would be at ``--to`` nodes (default 1000):
docs/benchmarks.md reads it.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from elastic_harness.bench import check_out
from elastic_harness.errors import HarnessError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rendezvous-scale", help="rendezvous messages and bytes per round at N light agents (JSON)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", default="2,4,8,16", help="comma-separated agent counts (default 2,4,8,16)")
    p.add_argument("--idle", type=float, default=5.0, help="seconds of a formed group's keep-alives (default 5)")
    p.add_argument("--to", type=int, default=1000, help="extrapolate to this many nodes (default 1000)")
    p.add_argument("--out", help="also write the JSON here")
    p.set_defaults(func=cmd_rendezvous)


def cmd_rendezvous(args: argparse.Namespace) -> int:
    try:
        counts = sorted({int(n) for n in str(args.nodes).split(",") if n.strip()})
    except ValueError:
        raise HarnessError(f"--nodes '{args.nodes}' is not a list of numbers", "e.g. --nodes 2,4,8,16") from None
    if not counts or counts[0] < 2 or args.idle <= 0 or args.to < 2:
        raise HarnessError("--nodes needs counts of 2 or more, --idle a positive time, --to 2 or more",
                           "e.g. --nodes 2,4,8,16 --idle 5 --to 1000")
    check_out(args.out)
    rows = [measure(n, args.idle) for n in counts]
    report = {"bench": "rendezvous-scale", "backend": "c10d (TCPStore), state sealed (rendezvous.sealed)",
              "idle_s": args.idle, "rows": rows, "extrapolated": extrapolate(rows, args.to)}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


class Tally:
    """Store calls and bytes, by phase (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.phase = "form"
        self.calls: dict[str, dict[str, int]] = {}
        self.state_bytes = 0

    def __call__(self, op: str, sent: int, got: int, lost: bool) -> None:
        with self._lock:
            row = self.calls.setdefault(self.phase, {"calls": 0, "writes": 0, "lost_races": 0,
                                                     "bytes_sent": 0, "bytes_received": 0})
            row["calls"] += 1
            row["writes"] += op == "compare_set"
            row["lost_races"] += lost
            row["bytes_sent"] += sent
            row["bytes_received"] += got
            self.state_bytes = max(self.state_bytes, got)


def measure(n: int, idle_s: float) -> dict:
    """One ``N``: form, idle, lose a node (module doc)."""
    import torch.distributed as dist

    from elastic_harness.bench.rendezvous import store_calls
    from elastic_harness.torchcompat import rdzv

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    run_id, key, tally = f"scale-{uuid.uuid4().hex[:8]}", uuid.uuid4().bytes * 2, Tally()
    handlers = [_handler(server.port, run_id, n, key) for _ in range(n)]
    for h in handlers:
        store_calls.count_store_calls(h, tally)
    try:
        t0 = time.monotonic()
        _all(handlers)
        form_s = time.monotonic() - t0
        tally.phase = "keep_alive"
        _idle(handlers, idle_s)
        tally.phase = "node_loss"
        lost = handlers[-1]
        rdzv.stop_heartbeats(lost)
        survivors = handlers[:-1]
        for h in survivors:  # as its peers' agents decide when it dies (here all in one process)
            h.group_failed()
            h.condemn([rdzv.this_node(lost)])
        t0 = time.monotonic()
        _all(survivors)
        loss_s = time.monotonic() - t0
        tally.phase = "closing"  # the handlers' goodbyes (``stop_changes``) are no round's
    finally:
        for h in handlers:
            rdzv.stop_heartbeats(h)
            h.stop_changes()  # before the store goes (``rendezvous.changes``)
        del server
    keep = tally.calls.get("keep_alive", {})
    per_s = {k: round(v / idle_s, 1) for k, v in keep.items()}
    return {"nodes": n, "state_bytes": tally.state_bytes, "form": tally.calls.get("form"),
            "form_s": round(form_s, 3), "keep_alive_per_s": per_s, "node_loss": tally.calls.get("node_loss"),
            "node_loss_s": round(loss_s, 3)}


def _handler(port: int, run_id: str, n: int, key: bytes):
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from elastic_harness.rendezvous.handler import create_handler

    conf = dict(join_timeout=120, last_call_timeout=2, close_timeout=10, heartbeat_timeout=5,
                keep_alive_interval=1, keep_alive_max_attempt=3, is_host=False, read_timeout=60,
                start_last_call_timeout=30)
    return create_handler(RendezvousParameters("c10d", f"127.0.0.1:{port}", run_id, 1, n, **conf), key=key)


def _all(handlers: Sequence) -> None:
    errors: list[BaseException] = []

    def join(h) -> None:
        try:
            h.next_rendezvous()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=join, args=(h,)) for h in handlers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    if errors:
        raise errors[0]


def _idle(handlers: Sequence, seconds: float) -> None:
    """A formed group: keep-alives run by themselves; each agent reads the state every
    ``POLL_S`` as its monitor loop does (``num_nodes_waiting``)."""
    from elastic_harness.rendezvous.handler import POLL_S

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for h in handlers:
            h.num_nodes_waiting()
        time.sleep(POLL_S)


def extrapolate(rows: Sequence[dict], to: int) -> dict:
    """Pure: each figure fitted as ``a N + b N^2`` (least squares over the rows) and its value
    at ``to`` nodes, with the fit's coefficients."""
    out = {"nodes": to}
    figures = {"state_bytes": lambda r: r["state_bytes"],
               "keep_alive_calls_per_s": lambda r: r["keep_alive_per_s"].get("calls", 0),
               "keep_alive_bytes_per_s": lambda r: r["keep_alive_per_s"].get("bytes_sent", 0)
               + r["keep_alive_per_s"].get("bytes_received", 0),
               "node_loss_calls": lambda r: (r["node_loss"] or {}).get("calls", 0),
               "node_loss_bytes": lambda r: (r["node_loss"] or {}).get("bytes_sent", 0)
               + (r["node_loss"] or {}).get("bytes_received", 0),
               "node_loss_lost_races": lambda r: (r["node_loss"] or {}).get("lost_races", 0)}
    ns = [r["nodes"] for r in rows]
    for name, get in figures.items():
        ys = [float(get(r)) for r in rows]
        if name == "state_bytes":  # a fixed part and one entry per node
            c, a = line(ns, ys)
            out[name] = {"c": round(c, 1), "a": round(a, 2), "at": round(c + a * to), "fit": "c + a N"}
            continue
        a, b = fit(ns, ys)
        out[name] = {"a": round(a, 4), "b": round(b, 6), "at": round(a * to + b * to * to), "fit": "a N + b N^2"}
    return out


def line(ns: Sequence[int], ys: Sequence[float]) -> tuple[float, float]:
    """Pure: least squares ``y = c + a n``."""
    k = len(ns)
    mean_n, mean_y = sum(ns) / k, sum(ys) / k
    var = sum((n - mean_n) ** 2 for n in ns)
    a = sum((n - mean_n) * (y - mean_y) for n, y in zip(ns, ys, strict=True)) / var if var else 0.0
    return mean_y - a * mean_n, a


def fit(ns: Sequence[int], ys: Sequence[float]) -> tuple[float, float]:
    """Pure: least squares ``y = a n + b n^2`` (no constant: nothing is sent for no node)."""
    s11 = sum(n * n for n in ns)
    s12 = sum(n ** 3 for n in ns)
    s22 = sum(n ** 4 for n in ns)
    t1 = sum(n * y for n, y in zip(ns, ys, strict=True))
    t2 = sum(n * n * y for n, y in zip(ns, ys, strict=True))
    det = s11 * s22 - s12 * s12
    if not det:
        return (t1 / s11 if s11 else 0.0), 0.0
    return (t1 * s22 - t2 * s12) / det, (s11 * t2 - s12 * t1) / det
