"""How the recovery benches start harness runs: the bench's job, and the processes they
spawn, signal and read the logs of (``recovery``, ``resize``)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
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
optimizer: {{name: adamw, lr: {lr}}}
checkpoint: {{every_steps: {every}, keep: 3}}
"""


def write_job(path: Path, *, steps: int, max_restarts: int, max_nodes: int = 1, hidden: int = 64,
              depth: int = 2, batch: int = 30, micro: int = 8, every: int = CKPT_EVERY,
              parallelism: str = "ddp", lr: float = 0.001) -> Path:
    """The bench's job. One node at most unless asked: a rendezvous that may still grow waits
    its last-call timeout every round (torchrun's default: 30 s), which no single-node
    comparison should pay."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(JOB.format(steps=steps, max_restarts=max_restarts, max_nodes=max_nodes, hidden=hidden,
                               depth=depth, batch=batch, micro=micro, every=every,
                               parallelism=parallelism, lr=lr))
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


def torchrun_command(spec, run_dir: Path, nproc: int, port: int, rdzv_id: str) -> list[str]:
    """Pure: one plain torchrun agent on our worker entry. ``--log-dir`` is the only flag
    beyond the comparison's: without it torchelastic makes ``torchelastic_*`` in /tmp."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={spec.nodes.min}:{spec.nodes.max}",
            f"--nproc-per-node={nproc}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id={rdzv_id}", f"--max-restarts={spec.max_restarts}",
            f"--log-dir={run_dir / 'logs'}",
            "-m", "elastic_harness.runtime.entry", str(run_dir / runfiles.RESOLVED_SPEC), str(run_dir)]


def torchrun_environ(base: Mapping[str, str], run_dir: Path, node: int) -> dict[str, str]:
    """Pure: torch's default worker store (not our private one), the node name our fault
    injector keys on, and torch's caches in the run dir (``launch.scratch``)."""
    from elastic_harness.launch.scratch import torch_environ

    env = {k: v for k, v in base.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    env["ELASTIC_HARNESS_NODE"] = str(node)
    return {**env, **torch_environ(run_dir, env)}


def _wait_for_port(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.1)
