"""Start one side of ``bench throughput`` for one case and read back its step stamps.

``launch`` writes what the side needs into its run dir (the harness's job YAML), starts the
side in its own process group with a time limit, and returns the JSON its rank 0 wrote
(``common.StepClock``) plus the wall time. The command builders are pure. Both sides
keep torch's compile cache (``launch.scratch``) and torchelastic's log dir in their run
dir. ``TMPDIR`` is left alone: loader processes hand batches over through a unix socket in
a ``pymp-*`` dir of the temp dir (removed when they exit), and under a run dir as deep as
pytest's that path outgrows what a socket path may be (108 bytes). A side that fails or
runs past its limit is stopped (SIGINT to its group first: the harness host stops its agents; then
SIGKILL) and reported as one error line naming its log.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from elastic_harness.bench.cpuwindow import machine_times
from elastic_harness.errors import HarnessError

HERE = Path(__file__).resolve().parent


def script_args(args: argparse.Namespace, row: Any, data_dir: Path, out: Path) -> list[str]:
    """What both scripts take (``common.parse_args``); ``row``: a ``main.Row``."""
    hsdp = ["--hsdp-shard", str(args.nproc_layout // 2)] if getattr(row, "hsdp", False) else []
    return ["--data", row.data, "--data-dir", str(data_dir), "--hidden", str(args.hidden),
            "--threads", str(args.threads), "--out", str(out), *hsdp]


def harness_job(args: argparse.Namespace, row: Any, data_dir: Path, out: Path, nproc: int,
                log_every: int) -> dict:
    """Pure: the script job for ``elastic-harness run``; defaults wherever the comparison
    allows (watchdog, events). Checkpoints (and the in-memory tier) off like the plain side, except in a row with
    saves: then every checkpoint default (in-memory tier, async saves, the final save) with
    a durable save every ``--save-every`` steps."""
    # Off means off: without durable saves the in-memory tier still snapshotted (every ~7
    # steps within its 3% budget), a cost the cheap row charged to the harness itself.
    checkpoint = ({"every_steps": args.save_every, **({} if row.tier else {"memory_every": 0})} if row.saves
                  else {"every_steps": 0, "save_final": False, "memory_every": 0})
    return {
        "name": f"bench-throughput-{row.name}",
        "script": {"path": str(HERE / "harness.py"), "args": script_args(args, row, data_dir, out)},
        "device": "cpu",  # the plain side is CPU/gloo
        "nproc_per_node": nproc,
        # the hsdp row: one node, replicate auto (= 2) x shard nproc/2, as the plain side's mesh
        "parallelism": {"shard": nproc // 2} if getattr(row, "hsdp", False) else "ddp",
        "max_restarts": 0,
        "train": {"steps": args.steps, "global_batch_size": args.global_batch,
                  "micro_batch_size": args.micro_batch, "log_every": log_every, "seed": 0},
        "data": {"workers": args.workers if row.costly else 0},
        "checkpoint": checkpoint,
        **({} if row.recovery == "in_place" else {"recovery": row.recovery}),
    }


def harness_command(job: Path, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "elastic_harness", "run", str(job), "--run-dir", str(run_dir)]


def plain_command(args: argparse.Namespace, row: Any, data_dir: Path, out: Path, nproc: int,
                  run_dir: Path, log_every: int) -> list[str]:
    """Pure: torchrun's standalone mode (a rendezvous on a port the OS picks) on the plain
    script; ``--log-dir`` only so torchelastic makes nothing in /tmp. In a row with saves,
    rank 0 ``torch.save``s into the run dir every ``--save-every`` steps."""
    saves = ["--save-every", str(args.save_every), "--save-dir", str(run_dir)] if row.saves else []
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            f"--log-dir={run_dir / 'logs'}", "-m", "elastic_harness.bench.throughput.plain",
            *script_args(args, row, data_dir, out), "--steps", str(args.steps),
            "--global-batch", str(args.global_batch), "--micro-batch", str(args.micro_batch),
            "--log-every", str(log_every), *saves]


def side_environ(base: dict[str, str], run_dir: Path) -> dict[str, str]:
    """Pure: torch's caches in the side's run dir."""
    from elastic_harness.launch.scratch import torch_environ

    return {**base, **torch_environ(run_dir, base)}


def launch(side: str, row: Any, args: argparse.Namespace, data_dir: Path, run_dir: Path,
           nproc: int, log_every: int) -> dict:
    """Run one side to the end; its rank 0's record with ``wall_s`` added."""
    run_dir.mkdir(parents=True)
    out = run_dir / "stamps.json"
    if side == "harness":
        job = run_dir.parent / f"{run_dir.name}.yaml"  # beside the run dir: `run` prepares that dir
        job.write_text(yaml.safe_dump(harness_job(args, row, data_dir, out, nproc, log_every)))
        cmd = harness_command(job, run_dir / "run")
    else:
        cmd = plain_command(args, row, data_dir, out, nproc, run_dir, log_every)
    log = run_dir / "output.log"
    busy0, ours0, t0 = machine_busy_s(), children_cpu_s(), time.perf_counter()
    code = run_bounded(cmd, log, side_environ(dict(os.environ), run_dir), timeout=limit_s(args))
    wall = time.perf_counter() - t0
    ours = children_cpu_s() - ours0
    if code != 0 or not out.is_file():
        why = "ran past its time limit" if code is None else f"exited {code}"
        raise HarnessError(f"the {side} run ({row.name} row) {why}; it said: {last_line(log)}",
                           "re-run with --keep --dir DIR to read its log")
    busy = None if busy0 is None else machine_busy_s() - busy0
    return {**json.loads(out.read_text()), "wall_s": round(wall, 2), "cpu_s": round(ours, 2),
            "others_cores": others_cores(busy, ours, wall)}


def machine_busy_s() -> float | None:
    """CPU seconds all cores spent busy since boot (Linux ``/proc/stat``: all but idle and
    iowait), else None."""
    t = machine_times()
    return t["user"] + t["kernel"] + t["steal"] if t else None


def children_cpu_s() -> float:
    """CPU seconds of every finished process we started, their descendants included (each
    side's launcher waits for its workers, and they for their loader processes)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def others_cores(busy_s: float | None, ours_s: float, wall_s: float) -> float | None:
    """Pure: cores other processes kept busy, on average, while a side ran (the load that
    the side competed with; ``None`` where the machine's busy time is unknown)."""
    if busy_s is None or wall_s <= 0:
        return None
    return round(max(0.0, busy_s - ours_s) / wall_s, 2)


def limit_s(args: argparse.Namespace) -> float:
    """Generous: start-up (import torch, rendezvous) plus 2 s per step."""
    return 180.0 + 2.0 * args.steps


def run_bounded(cmd: list[str], log: Path, env: dict[str, str], timeout: float) -> int | None:
    """Exit code, or None when it had to be stopped (past ``timeout``, or we were interrupted)."""
    with open(log, "ab") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        return None
    except BaseException:
        stop(proc)
        raise


def stop(proc: subprocess.Popen) -> None:
    """SIGINT the side's process group (the harness host then stops its agents), SIGKILL what
    is left after 30 s."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


EXCEPTION_LINE = re.compile(r"\b\w*(Error|Exception)\b: ")


def last_line(log: Path) -> str:
    """What a failed side said, in one line (``said``)."""
    try:
        return said(log.read_text(errors="replace"))
    except OSError:
        return "(no log)"


def said(text: str) -> str:
    """Pure: the last ``error:`` line of a side's output (our CLI's), else its last exception
    line other than torchrun's summary (``ChildFailedError``, whose banner of ``=`` says
    nothing), else its last line that is not a banner."""
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith("error:")]
    raised = [x for x in lines if EXCEPTION_LINE.search(x) and "ChildFailedError" not in x]
    plain = [x for x in lines if x.strip("=-_ ")]
    return (errors or raised or plain or ["(empty log)"])[-1][:300]
