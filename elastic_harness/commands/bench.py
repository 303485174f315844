"""``elastic-harness bench NAME``: measurements that print JSON.

Each benchmark is a module under ``elastic_harness.bench`` exposing ``register(subparsers)``
(one subparser setting ``func``). Add one by adding a line to ``BENCHES``.
"""

from __future__ import annotations

import argparse
import importlib

# name -> module, in --help order
BENCHES = {
    "buddy": "elastic_harness.bench.buddy",  # per-step cost of FSDP snapshots and buddy copies
    "checkpoint": "elastic_harness.bench.checkpoint",
    "recovery": "elastic_harness.bench.recovery",  # time to recover from faults
    "rendezvous": "elastic_harness.bench.rendezvous",  # a round on etcd's v3 API vs its v2 API
    "rendezvous-scale": "elastic_harness.bench.rdzv_scale",  # rendezvous messages and bytes per round at N
    "throughput": "elastic_harness.bench.throughput",  # samples/s vs a plain torchrun DDP script
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks that print JSON (checkpoint, ...)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    kinds = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for module_name in BENCHES.values():
        importlib.import_module(module_name).register(kinds)
