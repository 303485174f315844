"""The one job both sides of ``bench inflight`` train: jobs/mlp.yaml's MLP (1024 seeded
samples of 16 features, 64 wide, depth 2, AdamW at lr 0.01), a global batch of 30 in
micro-batches of at most 8, seed 0, for ``STEPS`` steps; the fault after ``KILL_AT``."""

from __future__ import annotations

from pathlib import Path

from elastic_harness.bench.recovery.launching import BenchJob, write_job

STEPS = 100
KILL_AT = 40
GLOBAL_BATCH = 30
MICRO_BATCH = 8
LR = 0.01
SEED = 0
HIDDEN = 64
DEPTH = 2
TASK_ARGS = {"samples": 1024, "dim": 16, "hidden": HIDDEN, "depth": DEPTH}  # launching.JOB's task


def write(path: Path, steps: int, nodes: int) -> Path:
    """The harness's job file (the recovery benches' template, with jobs/mlp.yaml's rate)."""
    return write_job(path,
                     BenchJob(steps=steps, max_restarts=3, max_nodes=nodes, hidden=HIDDEN, depth=DEPTH,
                              batch=GLOBAL_BATCH, micro=MICRO_BATCH, lr=LR))
