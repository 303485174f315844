"""How the recovery benches start harness runs: the bench's job, and the processes they
spawn, signal and read the logs of (``recovery``, ``resize``)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

from elastic_harness import runfiles

CKPT_EVERY = 10  # steps between checkpoints in the recovery runs

# The MLP job of jobs/mlp.yaml, inlined so an installed package can run the bench.
JOB = """\
name: bench-recovery
task:
  target: elastic_harness.tasks.mlp:MLPRegression
  args: {{samples: 1024, dim: 16, hidden: {hidden}, depth: {depth}}}
parallelism: {parallelism}
nodes: {{min: 1, max: {max_nodes}}}
nproc_per_node: 2
max_restarts: {max_restarts}
train: {{steps: {steps}, global_batch_size: {batch}, micro_batch_size: {micro}, seed: 0}}
optimizer: {{name: adamw, lr: 0.001}}
checkpoint: {{every_steps: {every}, keep: 3}}
"""


def write_job(path: Path, *, steps: int, max_restarts: int, max_nodes: int = 1, hidden: int = 64,
              depth: int = 2, batch: int = 30, micro: int = 8, every: int = CKPT_EVERY,
              parallelism: str = "ddp") -> Path:
    """The bench's job. One node at most unless asked: a rendezvous that may still grow waits
    its last-call timeout every round (torchrun's default: 30 s), which no single-node
    comparison should pay."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(JOB.format(steps=steps, max_restarts=max_restarts, max_nodes=max_nodes, hidden=hidden,
                               depth=depth, batch=batch, micro=micro, every=every,
                               parallelism=parallelism))
    return path


def _spawn(cmd: list[str], log: Path, env: dict) -> subprocess.Popen:
    with open(log, "ab") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)


def log_tails(run_dir: Path, lines: int = 30) -> dict[str, list[str]]:
    """The last ``lines`` lines of a run's host and agent logs (a failed run's evidence)."""
    out = {}
    for log in [run_dir / "bench-host.log", *sorted((run_dir / runfiles.LOGS).glob("agent-*.log"))]:
        with contextlib.suppress(OSError):
            out[log.name] = log.read_text(errors="replace").splitlines()[-lines:]
    return out


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, sig)
