"""Pure: when a fault is due, given what the run has shown so far.

Who fires which fault is the vocabulary's (``chaos.vocabulary``); this module only says
when: ``hits`` for faults a worker fires, ``due`` for the host's.
"""

from __future__ import annotations

from collections.abc import Sequence

from elastic_harness.chaos.vocabulary import KINDS, fired_by_worker
from elastic_harness.spec import FaultSpec


def hits(f: FaultSpec, step: int, rank: int, node: str, local_rank: int) -> bool:
    """Does step-keyed fault ``f`` hit this worker after it completes ``step``?

    Rank faults hit that global rank; node faults are fired by the node's local rank 0.
    """
    if not fired_by_worker(f) or step < f.at_step:
        return False
    if KINDS[f.kind].target == "rank":
        return f.target == rank
    return str(f.target) == node and local_rank == 0


def due(faults: Sequence[FaultSpec], fired: set[int], step: int, elapsed_s: float) -> list[int]:
    """Host-fired faults not yet fired whose step (or time) has been reached.

    ``step`` is the highest step the job has completed in this invocation; a fault at step
    S fires once the job first completes S (after a restart that replays S, not again).
    """
    out = []
    for i, f in enumerate(faults):
        if i in fired or fired_by_worker(f):
            continue
        if (f.at_step and step >= f.at_step) or (not f.at_step and elapsed_s >= f.at_seconds):
            out.append(i)
    return out


def unfired(faults: Sequence[FaultSpec], fired: Sequence[dict]) -> list[int]:
    """Indexes of the faults of ``faults`` that no ``fault`` event in ``fired`` (this run's,
    in order) carried out, matched by kind and target, each event used once: what a run that
    ended says it did not do (a fault after the run's last step or time, a node never reached)."""
    left = [(e.get("kind"), e.get("target")) for e in fired]
    missing = []
    for i, f in enumerate(faults):
        key = (f.kind, f.target)
        if key in left:
            left.remove(key)
        else:
            missing.append(i)
    return missing
