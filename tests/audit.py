"""Check, from ``samples/rank-*.jsonl``, that the steps which made the final model used every
sample of each epoch exactly once and kept the global batch fixed.

A step may have been run more than once (work after the last checkpoint is redone after a
crash); the run that counts is the *latest* generation that ran it, since every later
generation resumed from a checkpoint at or before that step.
"""

from __future__ import annotations

import json
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


def per_dp_rank(step: int, recs: list[dict]) -> list[dict]:
    """One record per data-parallel rank, in order: the ranks of a tensor-parallel group read
    the same share, so their records must agree (lines before ``dp_rank`` existed: one per rank)."""
    world = recs[0]["world_size"]
    assert [r["rank"] for r in recs] == list(range(world)), f"step {step}: ranks missing"
    shares: dict[int, dict] = {}
    for r in recs:
        first = shares.setdefault(r.get("dp_rank", r["rank"]), r)
        assert first["indices"] == r["indices"], f"step {step}: a tensor group read different samples"
    dp_size = recs[0].get("dp_size", world)
    assert sorted(shares) == list(range(dp_size)), f"step {step}: data-parallel ranks missing"
    return [shares[d] for d in range(dp_size)]


def audit(run_dir: Path, dataset_size: int, global_batch: int, steps: int) -> dict:
    """Assert the exactly-once property, counting data-parallel ranks; return what was seen
    (process and data-parallel world sizes per step: equal under ddp/fsdp)."""
    steps_seen = lineage(run_dir)
    assert sorted(steps_seen) == list(range(1, steps + 1)), "some steps have no record"
    stream: list[int] = []
    worlds, dp_sizes = {}, {}
    for step in range(1, steps + 1):
        recs = steps_seen[step]
        shares = per_dp_rank(step, recs)
        batch = [i for r in shares for i in r["indices"]]
        assert len(batch) == global_batch, f"step {step}: {len(batch)} samples, not {global_batch}"
        stream += batch
        worlds[step], dp_sizes[step] = recs[0]["world_size"], len(shares)
    full = len(stream) // dataset_size
    for e in range(full):
        epoch = stream[e * dataset_size:(e + 1) * dataset_size]
        assert sorted(epoch) == list(range(dataset_size)), f"epoch {e}: not each sample once"
    rest = stream[full * dataset_size:]
    assert len(set(rest)) == len(rest), "a sample repeats within the partial last epoch"
    return {"world_sizes": worlds, "dp_sizes": dp_sizes, "epochs": full}


def all_records(run_dir: Path) -> list[dict]:
    return [rec for path in sorted((run_dir / "samples").glob("rank-*.jsonl")) for rec in read_jsonl(path)]


def content_audit(run_dir: Path, epoch_size: int, global_batch: int, steps: int,
                  reference: Path | None = None, packed: bool = False) -> dict:
    """``audit`` by content: every step took positions ``[(step-1)*G, step*G)``; a position
    held the same sample (identity and content hash) in every generation and at every world
    size that read it (and in ``reference``, an uninterrupted run); an identity always held
    the same content; no identity repeats within an epoch, and each full epoch has
    ``epoch_size`` samples. Catches a source that returns other data than its position says.
    ``packed``: a packed sequence is named by its first token, and what follows that token
    depends on the epoch's shard order, so identities are compared within an epoch."""
    by_position: dict[int, tuple] = {}
    by_id: dict[str, str] = {}
    for rec in all_records(run_dir):
        assert "hashes" in rec, "train.record_samples wrote no content hashes"
        for p, i, h in zip(rec["positions"], rec["ids"], rec["hashes"], strict=True):
            key = json.dumps(i)
            assert by_position.setdefault(p, (key, h)) == (key, h), \
                f"position {p} held different samples in different attempts"
            named = (p // epoch_size, key) if packed else key
            assert by_id.setdefault(named, h) == h, f"sample {key} held different data in different reads"
    steps_seen = lineage(run_dir)
    assert sorted(steps_seen) == list(range(1, steps + 1)), "some steps have no record"
    worlds, epochs = {}, defaultdict(list)
    for step in range(1, steps + 1):
        recs = steps_seen[step]
        world = recs[0]["world_size"]
        positions = sorted(p for r in per_dp_rank(step, recs) for p in r["positions"])
        assert positions == list(range((step - 1) * global_batch, step * global_batch)), \
            f"step {step}: not the step's {global_batch} positions"
        worlds[step] = world
        for p in positions:
            epochs[p // epoch_size].append(by_position[p][0])
    for e, ids in epochs.items():
        assert len(set(ids)) == len(ids), f"epoch {e}: a sample repeats"
        if e < len(epochs) - 1:
            assert len(ids) == epoch_size, f"epoch {e}: {len(ids)} samples, not {epoch_size}"
    if reference is not None:
        ref = content_audit(reference, epoch_size, global_batch, steps, packed=packed)["samples"]
        assert {p: by_position[p] for p in ref} == ref, "the samples differ from the reference run"
    return {"world_sizes": worlds, "epochs": len(epochs),
            "samples": {p: by_position[p] for p in range(steps * global_batch)}}
