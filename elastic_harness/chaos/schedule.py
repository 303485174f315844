"""Pure: which faults are due, given what the run has shown so far."""

from __future__ import annotations

from collections.abc import Sequence

from elastic_harness.spec import FaultSpec

# Step-keyed faults on training processes fire inside the worker they hit (runtime.faults);
# the host fires the rest (time-keyed faults, add-node, partition).
WORKER_KINDS = frozenset({"kill-worker", "hang", "preempt", "kill-node"})


def fired_by_worker(f: FaultSpec) -> bool:
    return f.kind in WORKER_KINDS and bool(f.at_step)


def hits(f: FaultSpec, step: int, rank: int, node: str, local_rank: int) -> bool:
    """Does step-keyed fault ``f`` hit this worker after it completes ``step``?

    Rank faults hit that global rank; node faults are fired by the node's local rank 0.
    """
    if not fired_by_worker(f) or step < f.at_step:
        return False
    if f.kind in ("kill-worker", "hang"):
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


def parse_fault(text: str) -> FaultSpec:
    """``kind[:target][@step|@Ns]``, e.g. ``kill-worker:1@20``, ``kill-node:1@30s``."""
    from elastic_harness.errors import SpecError
    from elastic_harness.spec.loader import build

    head, _, when = text.partition("@")
    kind, _, target = head.partition(":")
    raw: dict = {"kind": kind, "target": int(target) if target.isdigit() else 0}
    if when.endswith("s"):
        raw["at_seconds"] = float(when[:-1])
    elif when.isdigit():
        raw["at_step"] = int(when)
    elif when:
        raise SpecError("--chaos", f"'{text}': '@{when}' is not a step or Ns")
    else:
        raw["at_seconds"] = 0.001  # now
    return build(FaultSpec, raw, "--chaos")
