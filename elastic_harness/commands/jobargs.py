"""What ``run`` and ``submit`` share: the job they are given and the flags that shape it.

One home, so the two commands cannot drift apart (``tests/cli/test_bad_args.py`` checks
that every flag of ``run`` is one of ``submit``'s too, or is named in ``RUN_ONLY``):

- JOB: a job YAML, or a training script (``.py``) whose job is the YAML beside it that
  names it, else the spec's defaults (``spec.script_job``: the rule ``eh.init()`` follows
  under torchrun and python too); everything after the script is the script's own
  (``cli.split_script_args``);
- ``--set``, ``--nnodes N|MIN:MAX`` and ``--nproc-per-node N|gpu|cpu|auto`` as spec
  overrides; ``--chaos`` faults join the spec's ``chaos`` list;
- ``--run-dir``, ``--fresh``, ``--netns``, ``--separate-hosts``, ``--verify``: what ``run`` does with them; a
  local ``submit`` passes them to its supervisor (a ``run``), a cluster scheduler refuses
  those it cannot honour (``submit.refuse_for_cluster``).

Torch-free: ``--help`` and ``spec`` import this.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path

from elastic_harness.errors import HarnessError
from elastic_harness.spec import load_job, script_job

# Flags of `run` that `submit` does not take, and why (tests/cli/test_bad_args.py reads it).
RUN_ONLY = {"--job-id": "the submission's id: submit makes one (or takes rendezvous.id) and passes it to run"}


def add_job_arguments(p: argparse.ArgumentParser) -> None:
    """JOB and the flags ``run`` and ``submit`` share (module doc)."""
    p.add_argument("job", help="job YAML file, or a training script (.py): its job is the YAML beside it "
                               "that names it (train.py -> train.yaml), else the spec's defaults; "
                               "everything after the script is the script's own arguments")
    p.add_argument("--run-dir", help="run directory (default runs/<job name>); re-using it resumes")
    p.add_argument("--fresh", action="store_true", help="start over: move earlier checkpoints aside")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec field")
    p.add_argument("--nnodes", metavar="N|MIN:MAX", help="the elastic node range, as torchrun takes it "
                                                        "(sets nodes.min and nodes.max)")
    p.add_argument("--nproc-per-node", metavar="N|gpu|cpu|auto",
                   help="workers per node: a number, gpu (one per GPU), cpu (one per CPU) or auto "
                        "(GPUs if any, else CPUs), as torchrun takes it; counted on this machine")
    p.add_argument("--chaos", action="append", default=[], metavar="FAULT",
                   help="inject a fault: KIND[:TARGET][@STEP|@SECONDSs], e.g. kill-worker:1@20")
    p.add_argument("--netns", action="store_true",
                   help="give every node its own network namespace and address (root; enables partition)")
    p.add_argument("--separate-hosts", action="store_true",
                   help="every node a simulated host of its own: its own network, pid and UTS namespaces "
                        "and host name (root; implies --netns): no same-host shortcut applies")
    p.add_argument("--verify", metavar="REF_RUN_DIR",
                   help="after the run, compare the final model with this run's (see `verify`)")


def take_script_flags(args: argparse.Namespace) -> None:
    """``run``/``submit [flags] train.py [args]``: the flags ``eh.init(argv=...)`` reads from a
    script's arguments under python and torchrun (``runtime.jobsource.script_flags``) count
    here too, so the job is the one ``python train.py [args]`` runs: ``--set`` after the
    host's own, ``--run-dir`` as the run directory. The script still gets every argument.
    ``--job`` after the script, or a second run directory, is refused (``HarnessError``)."""
    from elastic_harness.runtime.jobsource import script_flags

    job, run_dir, sets, _ = script_flags(args.script_args)
    if job is not None:
        raise HarnessError(f"--job {job} after the script: `{args.command}` takes the job as its first "
                           "argument", f"name the job first: elastic-harness {args.command} {job} "
                           "(its script.path names the script)")
    if run_dir is not None and args.run_dir is not None and Path(run_dir).resolve() != Path(args.run_dir).resolve():
        raise HarnessError(f"two run directories: --run-dir {args.run_dir} before the script and "
                           f"--run-dir {run_dir} after it", "give --run-dir once")
    args.run_dir = run_dir if run_dir is not None else args.run_dir
    args.set = [*args.set, *sets]


def overrides_of(args: argparse.Namespace, count_here: bool = True) -> list[str]:
    """``--set``, then ``--nnodes`` and ``--nproc-per-node`` as the spec fields they set.
    ``count_here`` False (a job that runs on other machines): ``gpu``/``cpu``/``auto`` are
    refused, since this machine's devices say nothing about those nodes."""
    overrides = list(args.set)
    if args.nnodes is not None:
        lo, _, hi = str(args.nnodes).partition(":")
        overrides += [f"nodes.min={lo}", f"nodes.max={hi or lo}"]
    if args.nproc_per_node is not None:
        value = str(args.nproc_per_node)
        if not count_here and not value.lstrip("-").isdigit():
            raise HarnessError(f"--nproc-per-node {value} would count this machine's devices, but the job "
                               "runs on other nodes", "give the workers per node as a number, "
                               "e.g. --nproc-per-node 8")
        overrides.append(f"nproc_per_node={nproc_count(value, '--nproc-per-node')}")
    return overrides


def nproc_count(value: str, flag: str) -> int:
    """``N``, ``gpu``, ``cpu`` or ``auto``, as the agent and torchrun read it (``launch.config``)."""
    from elastic_harness.launch.config import _nproc

    return _nproc(value, flag, _devices)


def _devices(kind: str) -> int:
    from elastic_harness.launch.config import device_count

    return device_count(kind)


def load_with_flags(args: argparse.Namespace, note: Callable[[str], None] = print,
                    overrides: list[str] | None = None):
    """The job ``args`` name (module doc), ``overrides`` (default ``overrides_of(args)``)
    applied, ``--chaos`` faults joined."""
    from elastic_harness.chaos.vocabulary import parse_fault

    overrides = overrides_of(args) if overrides is None else overrides
    spec = job_of(args.job, overrides, getattr(args, "script_args", None) or [], note)
    return dataclasses.replace(spec, chaos=[*spec.chaos, *(parse_fault(t) for t in args.chaos)])


def job_of(job: str, overrides: list[str], script_args: list[str] = (), note: Callable[[str], None] = print):
    """A job YAML, or a script's job (``spec.script_job``, said through ``note``), with
    ``script_args`` after the script's own ``script.args``."""
    if not str(job).endswith(".py"):
        if script_args:
            raise HarnessError(f"unrecognized arguments: {' '.join(script_args)}",
                               "flags go before the job file; only a script (.py) takes arguments after it")
        return load_job(job, overrides)
    script = Path(job)
    if not script.is_file():
        raise HarnessError(f"script '{job}' does not exist", "check the path")
    spec, beside, why_not = script_job(script, overrides)
    note(f"job: {beside} (the YAML beside the script)" if beside else
         f"job: the spec's defaults, named '{spec.name}'" + (f"; {why_not}" if why_not else ""))
    args = [*spec.script.args, *script_args]
    return dataclasses.replace(spec, script=dataclasses.replace(spec.script, args=args))
