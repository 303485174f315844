"""The local scheduler: a detached ``run`` on this machine supervises the job.

``submit`` starts ``elastic-harness run JOB --job-id ID ...`` in a session of its own
(``start_new_session``: no controlling terminal, so closing the terminal sends it no
SIGHUP), stdin from /dev/null, stdout and stderr to ``RUN_DIR/logs/supervisor-<id>.log``.
That ``run`` is the same code as an attached one: it starts the agents, follows the events,
and records its exit.

``stop``: SIGTERM to the supervisor, which stops its agents with SIGTERM; their workers
finish the step, save synchronously and exit (``run``'s ``StopSignal``). ``stop --now``:
SIGKILL to the supervisor's process group (for a job started by ``run`` in a terminal, to
its pid only: that group is the terminal's); its agents and their workers die with it by
their parent-death signal. Only a pid that is still the recorded process (same start time)
is signalled, never a process found by name.

Liveness is the supervisor's pid (``checkpoint.lock.pid_alive``), checkable only on the
host it runs on; elsewhere the status says so. A record's details are that process
(``Supervisor``); no flags of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

from elastic_harness import runfiles
from elastic_harness.checkpoint.lock import pid_alive, process_start
from elastic_harness.errors import HarnessError
from elastic_harness.events import read_events
from elastic_harness.lifecycle.api import LogQuery, Submission
from elastic_harness.lifecycle.logs import LogReader
from elastic_harness.lifecycle.observe import observe, submission_log
from elastic_harness.lifecycle.registry import JobRecord
from elastic_harness.lifecycle.state import JobStatus, Liveness, invocation_of


@dataclass(frozen=True)
class Supervisor:
    """A local job's ``JobRecord.details``: the process that supervises it."""

    host: str = ""  # where it runs
    pid: int = 0  # a detached `run`, or the `run` itself
    pid_start: str = ""  # its start time (tells a reused pid apart, see checkpoint.lock)
    session: bool = False  # it leads its own session (stop --now kills its group)

    @classmethod
    def of(cls, record: JobRecord) -> Supervisor:
        d = record.details
        return cls(str(d.get("host", "")), int(d.get("pid", 0)), str(d.get("pid_start", "")),
                   bool(d.get("session", False)))

    def alive(self) -> bool:
        return pid_alive({"pid": self.pid, "pid_start": self.pid_start})


def supervisor_log(job_id: str) -> str:
    return f"supervisor-{job_id}.log"


def supervisor_record(spec, run_dir: Path, job_file: Path, job_id: str, pid: int, via: str,
                      session: bool = False) -> JobRecord:
    sup = Supervisor(socket.gethostname(), pid, process_start(pid), session)
    return JobRecord(id=job_id, name=spec.name, scheduler="local", submitted=time.time(),
                     total_steps=spec.train.steps, run_dir=str(run_dir), job_file=str(job_file),
                     via=via, details=asdict(sup))


def supervisor_of(run_dir: Path, start: dict) -> JobRecord:
    """A record for a run dir's newest submission that the registry does not know (started
    before it existed, or elsewhere): its host ``start`` event, and the run dir's lock for
    the supervisor's pid when the lock is that submission's."""
    from elastic_harness.records.rundir import owner
    from elastic_harness.spec import load_job

    try:
        spec = load_job(str(run_dir / runfiles.RESOLVED_SPEC))
        name, steps = spec.name, spec.train.steps
    except HarnessError:
        name, steps = run_dir.name, 0
    job_id = str(start.get("run_id") or "")
    held = owner(run_dir) or {}
    mine = held.get("rdzv_id") == job_id
    sup = Supervisor(str(held.get("host", socket.gethostname())), int(held.get("pid", 0)),
                     str(held.get("pid_start", ""))) if mine else Supervisor(socket.gethostname())
    return JobRecord(id=job_id, name=name, scheduler="local", submitted=float(start.get("t", 0.0)),
                     total_steps=steps, run_dir=str(run_dir), via="run", details=asdict(sup))


def run_command(sub: Submission) -> list[str]:
    """Pure: the supervisor's command line, the user's own flags passed on as given; the job
    last, then a script's own arguments (``run [flags] train.py [args]``)."""
    cmd = [sys.executable, "-m", "elastic_harness", "run", "--run-dir", str(sub.run_dir), "--job-id", sub.job_id]
    for override in sub.overrides:
        cmd += ["--set", override]
    if sub.nodes is not None:
        cmd += ["--nodes", str(sub.nodes)]
    return [*cmd, *sub.run_flags, str(sub.job_file), *sub.script_args]


class LocalScheduler:
    name = "local"
    description = "a detached supervisor on this machine"
    keeps_run_dir = True

    def __init__(self, root: Path) -> None:
        self.root = root

    @staticmethod
    def add_options(parser: argparse.ArgumentParser) -> None:
        return None  # --nodes (simulated nodes) is `submit`'s own

    @staticmethod
    def options(args: argparse.Namespace) -> dict:
        return {}

    def where(self, record: JobRecord) -> str:
        return f"supervisor pid {Supervisor.of(record).pid}"

    def summary(self, record: JobRecord) -> dict:
        return {"pid": Supervisor.of(record).pid or None}

    def check(self) -> None:
        return None  # nothing to install: the supervisor is this package

    def submit(self, sub: Submission) -> JobRecord:
        logs = Path(sub.run_dir) / runfiles.LOGS
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / supervisor_log(sub.job_id), "ab") as log:
            proc = subprocess.Popen(run_command(sub), stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        return supervisor_record(sub.spec, Path(sub.run_dir), sub.job_file, sub.job_id, proc.pid,
                                 via="submit", session=True)

    def liveness(self, record: JobRecord) -> Liveness:
        sup = Supervisor.of(record)
        where = f"supervisor pid {sup.pid} on {sup.host}"
        if sup.host != socket.gethostname():
            return Liveness("unknown", detail=f"{where}: cannot be checked from {socket.gethostname()}")
        if sup.alive():
            return Liveness("running", detail=where)
        last = _last_error(Path(record.run_dir) / runfiles.LOGS / supervisor_log(record.id))
        return Liveness("gone", detail=f"{where} is gone" + (f" ({last})" if last else ""))

    def status(self, record: JobRecord) -> JobStatus:
        return observe(record, self.liveness(record), self.root)

    def logs(self, record: JobRecord, query: LogQuery, out: TextIO) -> None:
        reader = LogReader(Path(record.run_dir), record.id, query,
                           extra=[(supervisor_log(record.id), "supervisor")],
                           events=submission_log(Path(record.run_dir), record.id))
        reader.dump(out)
        if query.follow:
            reader.follow(out, active=lambda: self.liveness(record).phase == "running")

    def stop(self, record: JobRecord, now: bool) -> None:
        sup = Supervisor.of(record)
        if not sup.alive():
            return  # gone meanwhile: nothing of its own left to signal
        if not now:
            os.kill(sup.pid, signal.SIGTERM)
            return
        with contextlib.suppress(ProcessLookupError):
            if sup.session:
                os.killpg(sup.pid, signal.SIGKILL)  # it leads its own session: its group is its own
            else:
                os.kill(sup.pid, signal.SIGKILL)

    def leftovers(self, record: JobRecord) -> list[int]:
        """Pids of this submission's agents and workers (from its events) still running."""
        mine = invocation_of(read_events(Path(record.run_dir) / runfiles.EVENTS), record.id)
        pids = {int(e["pid"]) for e in mine if e.get("event") in ("worker",) or
                (e.get("event") == "start" and e.get("who") == "agent")}
        return sorted(p for p in pids if pid_alive({"pid": p}))


def _last_error(path: Path) -> str:
    """The last ``error:`` line a supervisor printed (why it ended early), or ""."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [line for line in lines if line.startswith("error: ")]
    return errors[-1][len("error: "):] if errors else ""
