"""torchft's side of ``bench inflight``: one run of the job under torchft 0.2.0, with a fault.

The processes: torchft's Rust lighthouse (``torchft_lighthouse``, shipped in its wheel, on a
port the OS picks; its log at info level holds its quorum decisions) and one process per
replica group (``torchft_worker``), set up as torchft's ``train_ddp.py`` and README set one
up on CPU. Replica group ``kill_group`` SIGKILLs its own process group: right after its step
``kill_at_step`` commits (``after_step``, what the harness's ``kill-node:1@40`` does), or in
the next step once that step's quorum holds it and before its gradient all-reduce
(``in_step``: every peer is then bound to reduce with it). Every process runs in a session
of its own and is ended through it; the caller owns ``scratch``.

``run`` returns ``torchft_stats.analyze``'s figures with the run's facts and a verdict.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from elastic_harness.bench.inflight import job, torchft_stats
from elastic_harness.launch.scratch import torch_environ

KILL_POINTS = ("after_step", "in_step")


@dataclasses.dataclass(frozen=True)
class Config:
    """A run's settings, as its worker processes read them (``SCRATCH/config.json``). The
    torchft values are the ones its README and ``train_ddp.py`` use; ``init_sync`` is off
    because every group builds the same seeded weights (torchft's docs advise it then)."""

    groups: int
    steps: int
    kill_group: int
    kill_at_step: int
    kill_point: str = "after_step"
    patch_ddp_hook: bool = False  # torchcompat.ftddp's hook: a failed all-reduce discards the step
    global_batch: int = job.GLOBAL_BATCH
    micro_batch: int = job.MICRO_BATCH
    lr: float = job.LR
    seed: int = job.SEED
    heartbeat_timeout_ms: int = 5000  # the lighthouse's default
    join_timeout_ms: int = 10000  # README
    quorum_tick_ms: int = 100  # README (and the default)
    manager_heartbeat_ms: int = 100  # Manager's default
    pg_timeout_s: float = 5.0  # train_ddp.py on CPU
    transport_timeout_s: float = 10.0  # train_ddp.py
    manager_timeout_s: float = 30.0  # train_ddp.py
    lighthouse: str = ""  # filled in once the lighthouse listens


def check(cfg: Config) -> None:
    """Pure: a setting that cannot run raises ValueError naming the option to change."""
    if cfg.groups < 2 or cfg.groups > cfg.global_batch:
        raise ValueError(f"--groups {cfg.groups}: pick 2 to {cfg.global_batch} replica groups")
    if not 0 <= cfg.kill_group < cfg.groups:
        raise ValueError(f"kill group {cfg.kill_group}: pick one from 0 to {cfg.groups - 1}")
    if not 1 <= cfg.kill_at_step < cfg.steps:
        raise ValueError(f"kill at step {cfg.kill_at_step}: pick one from 1 to {cfg.steps - 1}")
    if cfg.kill_point not in KILL_POINTS:
        raise ValueError(f"kill point {cfg.kill_point}: one of {', '.join(KILL_POINTS)}")


def run(scratch: Path, cfg: Config, timeout_s: float = 300.0) -> dict:
    """Train under torchft with the fault; the figures and facts of the run (see module doc)."""
    check(cfg)
    scratch.mkdir(parents=True, exist_ok=True)
    started, deadline = time.time(), time.monotonic() + timeout_s
    with Processes() as procs:
        cfg = dataclasses.replace(cfg, lighthouse=start_lighthouse(procs, scratch, cfg, deadline))
        (scratch / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
        caches = torch_environ(scratch, os.environ)  # torch's caches in the scratch folder, not /tmp
        workers = {f"group-{g}": procs.start(worker_command(scratch, g), scratch / f"group-{g}.out", caches)
                   for g in range(cfg.groups)}
        wait_for(lambda: all((scratch / f"ready-{g}").exists() for g in range(cfg.groups)), deadline, workers)
        (scratch / "go").touch()  # every Manager heartbeats now: the first quorum holds them all
        while time.monotonic() < deadline and any(p.poll() is None for p in workers.values()):
            time.sleep(0.05)
        timed_out = time.monotonic() >= deadline
    codes = {name: p.returncode for name, p in workers.items()}
    crashed = {name: last_error(scratch / f"{name}.out") for name, code in codes.items()
               if code not in (0, -signal.SIGKILL)}
    out = torchft_stats.report(scratch, cfg)
    verdict = ("timed out" if timed_out else "a process crashed" if crashed
               else "completed" if out["completed"] else "incomplete")
    return {"row": torchft_stats.row(out, verdict), "verdict": verdict, **out, "exit_codes": codes,
            "crashed": crashed, "wall_s": round(time.time() - started, 2), **versions()}


def worker_command(scratch: Path, group: int) -> list[str]:
    return [sys.executable, "-m", "elastic_harness.bench.inflight.torchft_worker",
            str(scratch / "config.json"), str(group)]


def lighthouse_exe() -> str:
    """The ``torchft_lighthouse`` beside this Python, else the one on PATH."""
    exe = Path(sys.executable).parent / "torchft_lighthouse"
    return str(exe) if exe.exists() else "torchft_lighthouse"


def start_lighthouse(procs: Processes, scratch: Path, cfg: Config, deadline: float) -> str:
    """Start the lighthouse on a free port; its address once its log says it listens."""
    cmd = [lighthouse_exe(), "--bind", "127.0.0.1:0", "--min_replicas", "1",
           "--quorum_tick_ms", str(cfg.quorum_tick_ms), "--join_timeout_ms", str(cfg.join_timeout_ms),
           "--heartbeat_timeout_ms", str(cfg.heartbeat_timeout_ms)]
    log = scratch / "lighthouse.log"
    proc = procs.start(cmd, log, env={"RUST_LOG": "info"})
    found: list[str] = []

    def listening() -> bool:
        m = re.search(r"Lighthouse listening on: \S+:(\d+)", log.read_text(errors="replace"))
        if m:
            found.append(m.group(1))
        return bool(found)

    wait_for(listening, deadline, {"lighthouse": proc})
    return f"http://127.0.0.1:{found[0]}"


def wait_for(ready: Callable[[], bool], deadline: float, watched: dict[str, subprocess.Popen]) -> None:
    """Poll ``ready()``; RuntimeError when a watched process ends first or time runs out."""
    while not ready():
        ended = [name for name, p in watched.items() if p.poll() is not None]
        if ended or time.monotonic() >= deadline:
            raise RuntimeError(f"torchft side: {', '.join(ended) or 'time ran out'} before training started")
        time.sleep(0.05)


def last_error(out: Path) -> str | None:
    """The last line of a process's output that names an exception (a traceback's last line)."""
    with contextlib.suppress(OSError):
        lines = [ln for ln in out.read_text(errors="replace").splitlines()
                 if re.match(r"^[\w.]*(Error|Exception)\b", ln)]
        return lines[-1][:300] if lines else None
    return None


def versions() -> dict:
    from importlib.metadata import version

    return {"torchft_version": version("torchft"), "torch_version": version("torch")}


class Processes:
    """What ``run`` starts, each in its own session; on leaving, whatever still runs gets
    SIGTERM, then SIGKILL, through its process group."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
        environ = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(log, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=environ, start_new_session=True)
        self.procs.append(proc)
        return proc

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in self.procs:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(p.pid, sig)
            for p in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=5.0)
