"""``elastic-harness bench NAME``: measurements that print JSON.

Each benchmark is a module under ``elastic_harness.bench`` exposing ``register(subparsers)``
(one subparser setting ``func``). Add one by adding a line to ``BENCHES``; a module that is
not written yet is skipped, like the top-level command registry does.
"""

from __future__ import annotations

import argparse
import importlib

# name -> module, in --help order
BENCHES = {
    "checkpoint": "elastic_harness.bench.checkpoint",
    "recovery": "elastic_harness.bench.recovery",  # time to recover from faults (planned)
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks that print JSON (checkpoint, ...)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    kinds = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for module_name in BENCHES.values():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name == module_name:
                continue
            raise
        module.register(kinds)
