"""``elastic-harness spec``: the job YAML reference, or a job validated and resolved.

With a job, ``task.target`` is imported, called with ``task.args`` and its model built
(what ``run`` does before starting any agent), or a script job's script is found and
compiled with the modules beside it that it imports, so a task that cannot be built or a
script that does not compile is reported here; that imports the task's module (and torch
with it). ``--no-task-check`` skips it, and the
output then says the task was not checked. The reference alone imports no torch.
"""

from __future__ import annotations

import argparse

from elastic_harness.commands.jobargs import job_of
from elastic_harness.spec import describe, dump_job, layout


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("spec", help="print every job field with its default and meaning, "
                                    "or validate a job and print it resolved",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("job", nargs="?", help="a job YAML to validate and resolve, or a training script (.py): "
                                          "its job as `run` finds it (the YAML beside it, else the defaults)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--no-task-check", action="store_true",
                   help="do not import and build task.target (faster; the task is then unchecked)")
    p.set_defaults(func=cmd_spec)


def cmd_spec(args: argparse.Namespace) -> int:
    if args.job:
        source: list[str] = []
        spec = job_of(args.job, args.set, note=source.append)  # a .py: the job `run` would use
        what = f"script.path '{spec.script.path}'" if spec.script.path else f"task.target '{spec.task.target}'"
        if args.no_task_check:
            verdict = f"# {what} was NOT checked (--no-task-check)"
        else:  # what `run` checks before starting any agent (one home: its preflight)
            from pathlib import Path

            from elastic_harness.commands.run import preflight

            notes: list[str] = []
            spec = preflight(spec, Path(args.job), note=notes.append)  # epochs become steps there
            what += "".join(f" ({n})" for n in notes)
            verdict = (f"# valid; {what} exists and compiles" if spec.script.path else
                       f"# valid; {what} imports and accepts task.args, and its model builds")
        shape = layout.describe(spec.parallelism, spec.nodes.min, spec.nodes.max, spec.nproc_per_node)
        # The verdict and the layout are YAML comments, so the output stays a loadable job file.
        print(dump_job(spec) + "".join(f"# {line}\n" for line in source) + f"# {shape}\n" + verdict)
        return 0
    rows = describe()
    width = max(len(key) for key, _, _ in rows)
    for key, default, text in rows:
        shown = f"  (default {default})" if default else ""
        print(f"{key:<{width}}  {text}{shown}")
    return 0
