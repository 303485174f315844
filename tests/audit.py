"""Check, from ``samples/rank-*.jsonl``, that the steps which made the final model used every
sample of each epoch exactly once and kept the global batch fixed.

A step may have been run more than once (work after the last checkpoint is redone after a
crash); the run that counts is the *latest* generation that ran it, since every later
generation resumed from a checkpoint at or before that step.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from tests.conftest import read_jsonl


def lineage(run_dir: Path) -> dict[int, list[dict]]:
    """``{step: records of the generation that counts, in rank order}``."""
    by_step: dict[int, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for path in (run_dir / "samples").glob("rank-*.jsonl"):
        for rec in read_jsonl(path):
            by_step[rec["step"]][rec["generation"]].append(rec)
    out = {}
    for step, gens in by_step.items():
        latest = max(gens.values(), key=lambda recs: max(r["t_ns"] for r in recs))
        out[step] = sorted(latest, key=lambda r: r["rank"])
    return out


def audit(run_dir: Path, dataset_size: int, global_batch: int, steps: int) -> dict:
    """Assert the exactly-once property; return what was seen (world sizes per step)."""
    steps_seen = lineage(run_dir)
    assert sorted(steps_seen) == list(range(1, steps + 1)), "some steps have no record"
    stream: list[int] = []
    worlds = {}
    for step in range(1, steps + 1):
        recs = steps_seen[step]
        world = recs[0]["world_size"]
        assert [r["rank"] for r in recs] == list(range(world)), f"step {step}: ranks missing"
        batch = [i for r in recs for i in r["indices"]]
        assert len(batch) == global_batch, f"step {step}: {len(batch)} samples, not {global_batch}"
        stream += batch
        worlds[step] = world
    full = len(stream) // dataset_size
    for e in range(full):
        epoch = stream[e * dataset_size:(e + 1) * dataset_size]
        assert sorted(epoch) == list(range(dataset_size)), f"epoch {e}: not each sample once"
    rest = stream[full * dataset_size:]
    assert len(set(rest)) == len(rest), "a sample repeats within the partial last epoch"
    return {"world_sizes": worlds, "epochs": full}
