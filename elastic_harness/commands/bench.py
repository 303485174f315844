"""``elastic-harness bench NAME``: measurements that print JSON.

Each benchmark is a module under ``elastic_harness.bench`` exposing ``register(subparsers)``
(one subparser setting ``func``). Add one by adding a line to ``BENCHES``.

A bench stopped by SIGTERM or SIGHUP (a CI runner's timeout, ``kill``, a closed terminal)
ends as one stopped by Ctrl-C does: its runs are stopped and its scratch directory removed
(each bench's ``finally``), exit 128 + the signal.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import signal
from collections.abc import Callable, Iterator

# name -> module, in --help order
BENCHES = {
    "buddy": "elastic_harness.bench.recovery.buddy",  # per-step cost of FSDP snapshots and buddy copies
    "checkpoint": "elastic_harness.bench.checkpoint.main",
    "inflight": "elastic_harness.bench.inflight.main",  # a node lost mid-training: the harness vs torchft
    "recovery": "elastic_harness.bench.recovery.main",  # time to recover from faults
    "rendezvous": "elastic_harness.bench.rendezvous.main",  # a round on etcd's v3 API vs its v2 API
    "rendezvous-scale": "elastic_harness.bench.rendezvous.scale",  # rendezvous messages and bytes per round at N
    "throughput": "elastic_harness.bench.throughput.main",  # samples/s vs a plain torchrun DDP script
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks that print JSON (checkpoint, ...)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    kinds = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for module_name in BENCHES.values():
        importlib.import_module(module_name).register(kinds)
    for bench in kinds.choices.values():
        bench.set_defaults(func=_stoppable(bench.get_default("func")))


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _stoppable(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    @functools.wraps(func)
    def run(args: argparse.Namespace) -> int:
        with _exit_on(STOP_SIGNALS):
            return func(args)

    return run


@contextlib.contextmanager
def _exit_on(signals: tuple[signal.Signals, ...]) -> Iterator[None]:
    """While the block runs, each of ``signals`` raises ``SystemExit(128 + signal)`` in the
    main thread, so ``finally`` blocks run; the handlers before are put back after."""
    def leave(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    before = {sig: signal.getsignal(sig) for sig in signals}
    for sig in signals:
        signal.signal(sig, leave)
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
