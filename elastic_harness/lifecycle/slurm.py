"""The Slurm scheduler: ``sbatch`` a rendered script; ``squeue``/``scontrol``/``sacct`` for
liveness; ``scancel`` to stop; the run directory for progress and logs.

``submit`` freezes the resolved job as ``RUN_DIR/lifecycle/<id>.job.yaml`` (a later edit of
the user's file does not change a queued job), writes ``<id>.sbatch`` beside it
(``slurm_script``), records the host ``start`` event (so the submission's events, requeues
included, fold as one invocation), then calls ``sbatch --parsable``.

Liveness, in order: ``squeue`` (queued or running jobs); ``scontrol show job`` (finished
jobs, for ``MinJobAge``, 300 s by default); ``sacct`` (with accounting). Slurm's exit code
is the batch script's, which is the agents' (``exitcodes``).

``stop``: ``scancel --signal=TERM`` reaches the job's steps (the agents, not the batch
shell): they drain and exit 143, and the batch script, seeing the stop request the caller
left, does not requeue. A job still queued is just cancelled. ``--now``:
``scancel --full --signal=KILL``, then ``scancel``.

A record's details: ``slurm_job``, the id sbatch gave. Flags: ``add_options`` (also used by
``elastic-harness slurm render``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TextIO

from elastic_harness import exitcodes, runfiles
from elastic_harness.errors import HarnessError
from elastic_harness.events import EventLog
from elastic_harness.lifecycle import shell
from elastic_harness.lifecycle.api import LogQuery, Submission
from elastic_harness.lifecycle.logs import LogReader
from elastic_harness.lifecycle.observe import observe
from elastic_harness.lifecycle.registry import LIFECYCLE_DIR, JobRecord
from elastic_harness.lifecycle.slurm_script import C10D_PORT, ScriptJob, SlurmOptions, render
from elastic_harness.lifecycle.state import JobStatus, Liveness
from elastic_harness.spec import dump_job

QUEUED = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD",
          "SPECIAL_EXIT"}
RUNNING = {"RUNNING", "COMPLETING", "SIGNALING", "STAGE_OUT", "RESIZING", "SUSPENDED", "STOPPED"}
_FIX = "install Slurm's client commands (Debian: apt-get install slurm-client), or use --scheduler local"


# ----- pure: what Slurm's commands print ----------------------------------------------------------
def parse_squeue(text: str) -> tuple[str, str, str] | None:
    """``squeue --noheader --format=%T|%r|%N`` -> (state, reason, nodes); None if not listed."""
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 3 and parts[0]:
            return parts[0], parts[1], parts[2]
    return None


def parse_scontrol(text: str) -> dict[str, str]:
    """``scontrol show job --oneliner`` -> its ``Key=Value`` fields ({} if none)."""
    fields = {}
    for token in text.split():
        key, sep, value = token.partition("=")
        if sep and key not in fields:
            fields[key] = value
    return fields


def parse_sacct(text: str, job: str) -> tuple[str, str] | None:
    """``sacct --noheader --parsable2 --format=JobID,State,ExitCode`` -> (state, exit code)
    of the allocation itself (not its steps); the state's first word ('CANCELLED by 0')."""
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 3 and parts[0] == job:
            return parts[1].split()[0] if parts[1] else "", parts[2]
    return None


def exit_code(text: str) -> int | None:
    """Slurm's ``CODE:SIGNAL`` -> the shell's convention (128 + signal when one killed it)."""
    code, _, sig = text.partition(":")
    if not code.isdigit():
        return None
    return 128 + int(sig) if sig.isdigit() and int(sig) else int(code)


def liveness(state: str, exit_text: str = "", reason: str = "") -> Liveness:
    """Pure: a Slurm job state (and exit code) -> ``Liveness``."""
    said = f"Slurm: {state}" + (f" ({reason})" if reason and reason != "None" else "")
    if state in QUEUED:
        return Liveness("queued", detail=said)
    if state in RUNNING:
        return Liveness("running", detail=said)
    code = exit_code(exit_text) if exit_text else None
    if state == "COMPLETED" and code is None:
        code = exitcodes.OK
    if state in ("PREEMPTED", "TIMEOUT") and not code:
        code = exitcodes.PREEMPTED  # signalled by Slurm; the agents drained if they had time
    return Liveness("gone", exit_code=code, detail=said)


# ----- its flags ------------------------------------------------------------------------------------
def add_slurm_options(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("slurm")
    s.add_argument("--partition", default="", help="slurm: partition")
    s.add_argument("--time", default="", help="slurm: time limit (MINUTES, HH:MM:SS or D-HH:MM:SS)")
    s.add_argument("--account", default="", help="slurm: account")
    s.add_argument("--cpus-per-task", type=int, default=0, help="slurm: CPUs per node's agent task")
    s.add_argument("--rdzv-port", type=int, default=C10D_PORT, help=f"slurm, c10d: store port on the first node (default {C10D_PORT})")
    s.add_argument("--max-requeues", type=int, default=5, help="slurm: requeues after preemption or infrastructure failures")
    s.add_argument("--sbatch", action="append", default=[], metavar="--OPTION=VALUE", help="slurm: another #SBATCH option")


def slurm_options(args: argparse.Namespace) -> dict:
    options = dict(partition=args.partition, time=args.time, account=args.account,
                   cpus_per_task=args.cpus_per_task, rdzv_port=args.rdzv_port,
                   max_requeues=args.max_requeues, python=sys.executable, extra=list(args.sbatch))
    SlurmOptions(**options).check()
    return options


# ----- the scheduler ---------------------------------------------------------------------------------
class SlurmScheduler:
    name = "slurm"
    description = "an sbatch script on a Slurm cluster"
    keeps_run_dir = True
    add_options = staticmethod(add_slurm_options)
    options = staticmethod(slurm_options)

    def __init__(self, root: Path) -> None:
        self.root = root

    def where(self, record: JobRecord) -> str:
        return f"Slurm job {_job(record)}"

    def summary(self, record: JobRecord) -> dict:
        return {"slurm_job": _job(record) or None}

    def check(self) -> None:
        for command in ("sbatch", "squeue", "scontrol", "scancel"):
            shell.need(command, "Slurm's client commands are needed for --scheduler slurm", _FIX)

    def submit(self, sub: Submission) -> JobRecord:
        run_dir = Path(sub.run_dir)
        folder = run_dir / LIFECYCLE_DIR
        folder.mkdir(parents=True, exist_ok=True)
        (run_dir / runfiles.LOGS).mkdir(exist_ok=True)
        job_file = folder / f"{sub.job_id}.job.yaml"
        job_file.write_text(dump_job(sub.spec))
        script = folder / f"{sub.job_id}.sbatch"
        job = ScriptJob(sub.spec.name, str(job_file), str(run_dir), sub.job_id, str(Path.cwd()))
        script.write_text(render(sub.spec, job, SlurmOptions(**sub.options)))
        events = EventLog(run_dir / runfiles.EVENTS)
        n = sub.spec.nodes
        events.emit("start", who="host", nodes=f"{n.min}:{n.max}", nproc_per_node=sub.spec.nproc_per_node,
                    run_id=sub.job_id, run_dir=str(run_dir), scheduler="slurm")
        result = shell.run(["sbatch", "--parsable", str(script)])
        slurm_job = result.stdout.strip().split(";")[0]
        if result.returncode != 0 or not slurm_job.isdigit():
            message = f"sbatch refused the job: {shell.first_line(result)}"
            events.emit("exit", who="host", code=exitcodes.PERMANENT, message=message)
            raise HarnessError(message, f"fix the Slurm options; the script is {script}")
        return JobRecord(id=sub.job_id, name=sub.spec.name, scheduler="slurm", submitted=time.time(),
                         total_steps=sub.spec.train.steps, run_dir=str(run_dir),
                         job_file=str(sub.job_file), details={"slurm_job": slurm_job})

    def liveness(self, record: JobRecord) -> Liveness:
        job = _job(record)
        queued = shell.run(["squeue", "--noheader", f"--jobs={job}", "--format=%T|%r|%N"])
        found = parse_squeue(queued.stdout) if queued.returncode == 0 else None
        if found is not None:
            return _where(liveness(found[0], reason=found[1]), job)
        shown = parse_scontrol(shell.run(["scontrol", "show", "job", "--oneliner", job]).stdout)
        if shown.get("JobState"):
            return _where(liveness(shown["JobState"], shown.get("ExitCode", ""), shown.get("Reason", "")), job)
        acct = shell.run(["sacct", "--noheader", "--parsable2", "--allocations", f"--jobs={job}",
                          "--format=JobID,State,ExitCode"]) if shell.which("sacct") else None
        done = parse_sacct(acct.stdout, job) if acct is not None and acct.returncode == 0 else None
        if done is not None:
            return _where(liveness(done[0], done[1]), job)
        return Liveness("gone", detail=f"Slurm job {job}: no longer known to squeue, scontrol or sacct")

    def status(self, record: JobRecord) -> JobStatus:
        return observe(record, self.liveness(record), self.root)

    def logs(self, record: JobRecord, query: LogQuery, out: TextIO) -> None:
        reader = LogReader(Path(record.run_dir), record.id, query,
                           extra=[(f"slurm-{_job(record)}.out", "batch")])
        reader.dump(out)
        if query.follow:
            reader.follow(out, active=lambda: self.liveness(record).phase in ("queued", "running"))

    def stop(self, record: JobRecord, now: bool) -> None:
        job = _job(record)
        if now:
            shell.run(["scancel", "--full", "--signal=KILL", job])
            result = shell.run(["scancel", job])
        elif self.liveness(record).phase == "queued":
            result = shell.run(["scancel", job])  # nothing started: nothing to drain
        else:
            result = shell.run(["scancel", "--signal=TERM", job])  # the agents (steps), not the batch shell
        if result.returncode != 0:
            raise HarnessError(f"scancel of Slurm job {job} failed: {shell.first_line(result)}",
                               "check `squeue --jobs " + job + "`; a finished job needs no stop")


def _job(record: JobRecord) -> str:
    """The Slurm job id in ``record.details``."""
    return str(record.details.get("slurm_job", ""))


def _where(live: Liveness, job: str) -> Liveness:
    return Liveness(live.phase, live.exit_code, f"Slurm job {job}: {live.detail.removeprefix('Slurm: ')}")
