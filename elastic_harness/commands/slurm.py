"""``elastic-harness slurm render JOB.yaml``: print the sbatch script, for submitting by hand.

It is the script ``submit --scheduler slurm`` writes and submits (``lifecycle.slurm_script``),
except that it reads the job file you name (with your ``--set``s) and takes its job id from
Slurm's (``<name>-slurm<SLURM_JOB_ID>``). Stop such a job gracefully with
``scancel --signal=TERM <id>`` after creating ``RUN_DIR/lifecycle/<job id>.stop`` (without
it, the script requeues a drained job, as after a preemption).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from elastic_harness.lifecycle.slurm import add_slurm_options, slurm_options
from elastic_harness.lifecycle.slurm_script import ScriptJob, SlurmOptions, render
from elastic_harness.spec import load_job


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("slurm", help="Slurm: the sbatch script for a job")
    actions = parser.add_subparsers(dest="slurm_action", metavar="ACTION", required=True)
    r = actions.add_parser("render", help="print the sbatch script that runs a job", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("job", help="job YAML file")
    r.add_argument("--run-dir", help="run directory on storage every node mounts (default runs/<job name>)")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec field")
    add_slurm_options(r)
    r.set_defaults(func=cmd_render)


def cmd_render(args: argparse.Namespace) -> int:
    spec = load_job(args.job, args.set)
    options = slurm_options(args)
    run_dir = Path(args.run_dir or Path("runs") / spec.name).resolve()
    job = ScriptJob(spec.name, str(Path(args.job).resolve()), str(run_dir), "", os.getcwd(), tuple(args.set))
    print(render(spec, job, SlurmOptions(**options)), end="")
    return 0
