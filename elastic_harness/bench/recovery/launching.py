"""How the recovery benches start harness runs: the bench's job, and the processes they
spawn, signal and read the logs of (``recovery``, ``resize``); ``launch`` runs the job under
the harness or under plain torchrun (one agent per simulated node) and waits for it, within
a bound (``_wait``)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from elastic_harness import runfiles
from elastic_harness.events import EventLog

CKPT_EVERY = 10  # steps between checkpoints in the recovery runs
STALL_S = 240.0  # a launcher whose run writes no event for this long is stuck: stop it

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


@dataclass(frozen=True)
class BenchJob:
    """The bench job's settings (``JOB``'s fields): its length and restarts, its nodes at most,
    the model's width and depth, the global and micro batch, the checkpoint period, the
    layout and the learning rate."""

    steps: int
    max_restarts: int
    max_nodes: int = 1
    hidden: int = 64
    depth: int = 2
    batch: int = 30
    micro: int = 8
    every: int = CKPT_EVERY
    parallelism: str = "ddp"
    lr: float = 0.001


def write_job(path: Path, job: BenchJob) -> Path:
    """The bench's job. One node at most unless asked: a rendezvous that may still grow waits
    its last-call timeout every round (torchrun's default: 30 s), which no single-node
    comparison should pay."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(JOB.format(**asdict(job)))
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


def launch(launcher: str, job: Path, run_dir: Path, *, nodes: int, nproc: int, chaos: list[str],
           timeout: int, sets: list[str] | None = None) -> int | None:
    if launcher == "harness":
        return run_harness(job, run_dir, nodes, nproc, chaos, timeout, sets or [])
    return run_torchrun(job, run_dir, nodes, nproc, chaos, timeout)


def run_harness(job: Path, run_dir: Path, nodes: int, nproc: int, chaos: list[str], timeout: int,
                sets: list[str]) -> int | None:
    cmd = [sys.executable, "-m", "elastic_harness", "run", str(job), "--run-dir", str(run_dir),
           "--nodes", str(nodes), "--nproc-per-node", str(nproc)]
    cmd += [a for s in sets for a in ("--set", s)] + [a for c in chaos for a in ("--chaos", c)]
    run_dir.mkdir(parents=True, exist_ok=True)
    proc = _spawn(cmd, run_dir / "bench-host.log", dict(os.environ))
    return _wait([proc], timeout, run_dir / runfiles.EVENTS, interrupt_first=True)[0]


def run_torchrun(job: Path, run_dir: Path, nodes: int, nproc: int, chaos: list[str], timeout: int) -> int | None:
    """Plain torchrun agents (one per simulated node) on our worker entry; what they are given
    and why: ``bench.recovery.main``'s module doc."""
    import dataclasses

    from elastic_harness.chaos.vocabulary import parse_fault
    from elastic_harness.checkpoint.lock import Holder
    from elastic_harness.records.rundir import prepare
    from elastic_harness.simcluster.cluster import free_port
    from elastic_harness.spec import load_job

    spec = load_job(job, [f"nproc_per_node={nproc}"])
    spec = dataclasses.replace(spec, chaos=[parse_fault(c) for c in chaos])
    port = free_port()
    rdzv_id = f"bench-{os.getpid()}-{port}"
    claim = prepare(run_dir, spec, holder=Holder.this_process(spec.name, rdzv_id))
    with claim:
        return _torchrun_nodes(spec, claim.path, nodes, nproc, port, rdzv_id, timeout)


def _torchrun_nodes(spec, run_dir: Path, nodes: int, nproc: int, port: int, rdzv_id: str,
                    timeout: int) -> int | None:
    EventLog(run_dir / runfiles.EVENTS).emit("start", who="host", launcher="torchrun", nodes=nodes)
    procs = []
    for i in range(nodes):
        cmd = torchrun_command(spec, run_dir, nproc, port, rdzv_id=rdzv_id)
        procs.append(_spawn(cmd, run_dir / f"torchrun-{i}.log", torchrun_environ(os.environ, run_dir, i)))
        if i == 0:
            _wait_for_port(port, procs[0], 60)  # node 0 hosts the store
    codes = _wait(procs, timeout, run_dir / runfiles.EVENTS)
    stuck = None in codes
    EventLog(run_dir / runfiles.EVENTS).emit("exit", who="host", code=None if stuck else max(codes),
                                            message="stopped by the bench: no progress or timeout" if stuck else "")
    return None if stuck else codes[0]


def _wait(procs: list[subprocess.Popen], timeout: float, progress: Path, interrupt_first: bool = False,
          stall_s: float = STALL_S) -> list[int | None]:
    """Wait for all. Past ``timeout``, or when ``progress`` (the event log) has not grown for
    ``stall_s``, interrupt (the harness host cleans up its agents), then kill the groups.
    Returns exit codes, None for a process that had to be stopped."""
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if progress.exists() and time.time() - progress.stat().st_mtime > stall_s:
                break
            time.sleep(0.5)
    except BaseException:  # interrupted: leave nothing running
        for p in procs:
            _signal_group(p, signal.SIGINT if interrupt_first else signal.SIGKILL)
        raise
    late = [p for p in procs if p.poll() is None]
    for p in late:
        if interrupt_first:
            _signal_group(p, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=60)
        _signal_group(p, signal.SIGKILL)
        p.wait()
    return [None if p in late else p.returncode for p in procs]
