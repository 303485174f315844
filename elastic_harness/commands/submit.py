"""``elastic-harness submit JOB.yaml``: validate, start detached, print the job id.

``--scheduler local`` (default) starts a supervisor on this machine that outlives the
terminal; ``slurm`` submits an sbatch script; ``k8s`` applies the rendered manifests. Then
``status``, ``logs`` and ``stop`` take the id (``commands/jobs.py``). Submitting the same job
or run directory again, once the earlier submission has ended, resumes from its checkpoints;
while it is still active, the submission is refused, naming it.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path

from elastic_harness import runfiles
from elastic_harness.checkpoint import lock
from elastic_harness.commands import jobargs
from elastic_harness.commands.jobargs import add_job_arguments
from elastic_harness.commands.support import resumepoint
from elastic_harness.errors import HarnessError, RunDirError
from elastic_harness.launch.config import new_rdzv_id
from elastic_harness.lifecycle import registry
from elastic_harness.lifecycle.api import Submission
from elastic_harness.lifecycle.schedulers import SCHEDULERS, scheduler_class, scheduler_for
from elastic_harness.lifecycle.state import ACTIVE
from elastic_harness.records.rundir import owner


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("submit", help="start a job detached (here, on Slurm or on Kubernetes) and print its id",
                       description="Start a job detached: `submit JOB.yaml [flags]`, or `submit [flags] "
                                   "train.py [script args]` as `run` takes them (commands.jobargs).")
    add_job_arguments(p)  # shared with run: the job, --set, --nnodes, --nproc-per-node, --chaos, ...
    kinds = {name: scheduler_class(name) for name in SCHEDULERS}
    p.add_argument("--scheduler", choices=list(kinds), default="local", help="where it runs (default local): " +
                   "; ".join(f"{name}, {cls.description}" for name, cls in kinds.items()))
    p.add_argument("--nodes", help="local: simulated nodes to start (N); slurm, k8s: the elastic range "
                                   "to ask for (N or MIN:MAX, over nodes.min/max)")
    p.add_argument("--json", action="store_true", help="print the submission as JSON")
    for cls in kinds.values():
        cls.add_options(p)  # each scheduler's own flags
    p.set_defaults(func=cmd_submit)


def overrides_of(args: argparse.Namespace) -> list[str]:
    """``--set``, ``--nnodes``, ``--nproc-per-node`` (``jobargs``), and ``--nodes`` as a range
    for the cluster schedulers."""
    cluster = args.scheduler != "local"
    out = jobargs.overrides_of(args, count_here=not cluster)
    if args.nodes is not None and cluster:
        lo, _, hi = args.nodes.partition(":")
        out += [f"nodes.min={lo}", f"nodes.max={hi or lo}"]
    return out


# `run` flags a cluster scheduler cannot honour: (attribute, flag, fix). Local submissions pass them
# to their supervisor, which is a `run`.
_LOCAL_ONLY = (
    ("fresh", "--fresh", "submit to a new --run-dir (slurm), or delete the job's volume claim (k8s)"),
    ("netns", "--netns", "simulated hosts are for jobs on this machine: use --scheduler local"),
    ("separate_hosts", "--separate-hosts", "simulated hosts are for jobs on this machine: use --scheduler local"),
    ("verify", "--verify", "compare afterwards: elastic-harness verify RUN_DIR REF_RUN_DIR"),
)


def refuse_for_cluster(args: argparse.Namespace, spec) -> None:
    """One line for a ``run`` flag or fault a Slurm or Kubernetes job cannot carry out: no
    ``run`` supervises it there, so only faults the workers fire themselves (step-keyed)
    happen."""
    if args.scheduler == "local":
        return
    for attr, flag, fix in _LOCAL_ONLY:
        if getattr(args, attr):
            raise HarnessError(f"{flag} is for --scheduler local (its supervisor is a `run`), not "
                               f"{args.scheduler}", fix)
    from elastic_harness.chaos.vocabulary import fault_text, fired_by_worker

    hosted = [fault_text(f) for f in spec.chaos if not fired_by_worker(f)]
    if hosted:
        raise HarnessError(f"fault {', '.join(hosted)} is fired by a local `run` supervisor, which a "
                           f"{args.scheduler} job does not have", "use --scheduler local, or faults the "
                           "workers fire at a step (kill-worker, hang, preempt, kill-node @STEP)")


def cmd_submit(args: argparse.Namespace) -> int:
    root = registry.state_dir()
    overrides = overrides_of(args)
    spec = jobargs.load_with_flags(args, note=_note, overrides=overrides)
    refuse_for_cluster(args, spec)
    sched = scheduler_for(args.scheduler, root)
    options = _options(args, spec, sched)
    sched.check()
    registry.ensure_writable(root)
    run_dir, nodes = None, None
    if sched.keeps_run_dir:
        spec, run_dir, nodes = _check_local(args, spec, root)
        done = "" if args.fresh else resumepoint.check(spec, run_dir)
        if done:  # nothing to train: nothing is submitted
            print(done, file=sys.stderr)
            if args.json:  # a script reading stdout gets an answer, not an empty line
                print(json.dumps({"id": None, "submitted": False, "finished": True, "run_dir": str(run_dir)}))
            return 0
        _make(run_dir)
    job_id = spec.rendezvous.id or new_rdzv_id(spec.name)
    record = sched.submit(Submission(spec, Path(args.job).resolve(), job_id, run_dir, overrides, nodes, options,
                                     script_args=list(getattr(args, "script_args", None) or []),
                                     run_flags=run_flags(args)))
    registry.save(record, root)
    _report(record, sched, args.json)
    return 0


def _check_local(args: argparse.Namespace, spec, root: Path) -> tuple:
    """What a job whose run dir is here (local, Slurm) is checked for before it is submitted,
    as ``run`` checks it: (the spec preflight resolved, the run dir, the local node count)."""
    from elastic_harness.commands.run import check_faults, preflight
    from elastic_harness.records.rundir import check_paths
    from elastic_harness.torchcompat.host import check_and_warn

    nodes = _local_nodes(args, spec)
    check_faults(spec, nodes or spec.nodes.min, args.netns or args.separate_hosts)
    check_paths(Path(args.run_dir or Path("runs") / spec.name), spec)  # before torch: at once
    if args.verify:  # its supervisor compares at the end: a reference it cannot read is refused now
        from elastic_harness.commands.report import check_reference

        check_reference(Path(args.verify))
    check_and_warn(spec)  # the torch this host runs the job with (torchcompat.host)
    spec = preflight(spec, Path(args.job))
    run_dir = Path(args.run_dir or Path("runs") / spec.name).resolve()
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"run directory '{run_dir}' is not a directory", "pass --run-dir a directory")
    refuse_if_busy(run_dir, root)
    return spec, run_dir, nodes


def run_flags(args: argparse.Namespace) -> list[str]:
    """The ``run`` flags a local supervisor is given besides the job and its overrides."""
    out = [x for t in args.chaos for x in ("--chaos", t)]
    out += ["--fresh"] * args.fresh + ["--netns"] * args.netns + ["--separate-hosts"] * args.separate_hosts
    return out + (["--verify", str(Path(args.verify).resolve())] if args.verify else [])


def _note(line: str) -> None:
    print(line, file=sys.stderr)  # stdout is the job id (or --json): scripts read it


def _make(run_dir: Path) -> None:
    try:
        (run_dir / runfiles.LOGS).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"cannot create run directory '{run_dir}': {e.strerror or e}",
                          "pass --run-dir to a directory you can write") from None


def _options(args: argparse.Namespace, spec, sched) -> dict:
    """The scheduler's own flags; where the job runs from what is sent (no run directory
    here: Kubernetes), the spec as written and its script's files go with them."""
    options = sched.options(args)
    if not sched.keeps_run_dir:
        from elastic_harness.commands.k8s import refuse_epochs, script_for_pods

        refuse_epochs(spec)
        options["script_files"] = script_for_pods(spec, Path(args.job))
    return options


def _local_nodes(args: argparse.Namespace, spec) -> int | None:
    if args.scheduler != "local" or args.nodes is None:
        return None
    try:
        nodes = int(args.nodes)
    except ValueError:
        raise HarnessError(f"--nodes '{args.nodes}' is not a number of nodes",
                           "local jobs start N simulated nodes: --nodes 2") from None
    if not spec.nodes.min <= nodes <= spec.nodes.max:
        raise HarnessError(f"--nodes {nodes} is outside nodes.min..max ({spec.nodes.min}..{spec.nodes.max})",
                           "pick a count in range or change nodes in the job")
    return nodes


def refuse_if_busy(run_dir: Path, root: Path) -> None:
    """A run dir whose lock a live process holds, or that an active job was submitted to
    (a queued Slurm job holds no lock yet), takes no other submission."""
    held = owner(run_dir)
    if held and not lock.staleness(held, time.time(), socket.gethostname(), lock.pid_alive, lock.STALE_S):
        raise HarnessError(f"run directory '{run_dir}' is in use by {lock.describe(held)}",
                           f"stop it first (elastic-harness stop {held.get('rdzv_id', '')}), or pass another --run-dir")
    for rec in registry.records(root):
        if rec.run_dir == str(run_dir):
            st = scheduler_for(rec.scheduler, root).status(rec)
            if st.state in ACTIVE:
                raise HarnessError(f"run directory '{run_dir}' belongs to job {rec.id}, which is {st.state} "
                                   f"({rec.scheduler})", f"stop it first (elastic-harness stop {rec.id}), "
                                   "or pass another --run-dir")


def _report(record: registry.JobRecord, sched, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"id": record.id, "scheduler": record.scheduler, "run_dir": record.run_dir,
                          **sched.summary(record)}))
        return
    where = sched.where(record)
    print(record.id)
    print(f"submitted to {record.scheduler} ({where}{', run dir ' + record.run_dir if record.run_dir else ''})",
          file=sys.stderr)
    print(f"  elastic-harness status {record.id}   |   logs -f {record.id}   |   stop {record.id}", file=sys.stderr)
