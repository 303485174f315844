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
from elastic_harness.errors import HarnessError, RunDirError
from elastic_harness.launch.config import new_rdzv_id
from elastic_harness.lifecycle import registry
from elastic_harness.lifecycle.api import SCHEDULERS, Submission
from elastic_harness.lifecycle.schedulers import scheduler_for
from elastic_harness.lifecycle.slurm_script import C10D_PORT, SlurmOptions
from elastic_harness.lifecycle.state import ACTIVE
from elastic_harness.rundir import owner
from elastic_harness.spec import load_job


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("submit", help="start a job detached (here, on Slurm or on Kubernetes) and print its id")
    p.add_argument("job", help="job YAML file")
    p.add_argument("--scheduler", choices=SCHEDULERS, default="local", help="where it runs (default local)")
    p.add_argument("--run-dir", help="run directory (default runs/<job name>); re-using it resumes (local, slurm)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec field")
    p.add_argument("--nodes", help="local: simulated nodes to start (N); slurm, k8s: the elastic range "
                                   "to ask for (N or MIN:MAX, over nodes.min/max)")
    p.add_argument("--nproc-per-node", type=int, help="override nproc_per_node")
    p.add_argument("--json", action="store_true", help="print the submission as JSON")
    add_slurm_options(p)
    k = p.add_argument_group("k8s")
    k.add_argument("--flavor", choices=("pytorchjob", "plain"), default="pytorchjob", help="k8s: manifest flavor")
    k.add_argument("--image", help="k8s: container image (default: the package's, see k8s render)")
    k.add_argument("--namespace", help="k8s: namespace (default: default)")
    p.set_defaults(func=cmd_submit)


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


def overrides_of(args: argparse.Namespace) -> list[str]:
    """``--set`` plus the flags that are spec fields (``--nproc-per-node``; ``--nodes`` as a
    range for the cluster schedulers)."""
    out = list(args.set)
    if args.nproc_per_node is not None:
        out.append(f"nproc_per_node={args.nproc_per_node}")
    if args.nodes is not None and args.scheduler != "local":
        lo, _, hi = args.nodes.partition(":")
        out += [f"nodes.min={lo}", f"nodes.max={hi or lo}"]
    return out


def cmd_submit(args: argparse.Namespace) -> int:
    root = registry.state_dir()
    overrides = overrides_of(args)
    spec = load_job(args.job, overrides)
    options = _options(args, spec)
    sched = scheduler_for(args.scheduler, root)
    sched.check()
    registry.ensure_writable(root)
    run_dir, nodes = None, None
    if args.scheduler != "k8s":
        from elastic_harness.commands.run import preflight
        from elastic_harness.rundir import check_paths
        from elastic_harness.torchcompat.host import check_and_warn

        nodes = _local_nodes(args, spec)
        check_paths(Path(args.run_dir or Path("runs") / spec.name), spec)  # before torch: at once
        check_and_warn(spec)  # the torch this host runs the job with (torchcompat.host)
        spec = preflight(spec, Path(args.job))
        run_dir = Path(args.run_dir or Path("runs") / spec.name).resolve()
        if run_dir.exists() and not run_dir.is_dir():
            raise RunDirError(f"run directory '{run_dir}' is not a directory", "pass --run-dir a directory")
        refuse_if_busy(run_dir, root)
        _make(run_dir)
    job_id = spec.rendezvous.id or new_rdzv_id(spec.name)
    record = sched.submit(Submission(spec, Path(args.job).resolve(), job_id, run_dir, overrides, nodes, options))
    registry.save(record, root)
    _report(record, args.json)
    return 0


def _make(run_dir: Path) -> None:
    try:
        (run_dir / runfiles.LOGS).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"cannot create run directory '{run_dir}': {e.strerror or e}",
                          "pass --run-dir to a directory you can write") from None


def _options(args: argparse.Namespace, spec) -> dict:
    if args.scheduler == "slurm":
        return slurm_options(args)
    if args.scheduler == "k8s":
        from elastic_harness.commands.k8s import refuse_epochs, script_for_pods
        from elastic_harness.k8s import DEFAULT_IMAGE

        refuse_epochs(spec)
        return {"flavor": args.flavor, "image": args.image or DEFAULT_IMAGE, "namespace": args.namespace or "",
                "script_text": script_for_pods(spec, Path(args.job))}
    return {}


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


def _report(record: registry.JobRecord, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"id": record.id, "scheduler": record.scheduler, "run_dir": record.run_dir,
                          "slurm_job": record.slurm_job or None, "k8s": record.k8s or None, "pid": record.pid or None}))
        return
    where = {"local": f"supervisor pid {record.pid}", "slurm": f"Slurm job {record.slurm_job}",
             "k8s": f"Kubernetes {record.k8s.get('namespace')}/{record.k8s.get('name')}"}[record.scheduler]
    print(record.id)
    print(f"submitted to {record.scheduler} ({where}{', run dir ' + record.run_dir if record.run_dir else ''})",
          file=sys.stderr)
    print(f"  elastic-harness status {record.id}   |   logs -f {record.id}   |   stop {record.id}", file=sys.stderr)
