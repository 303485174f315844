"""Which job a worker runs: parsed once per process, then passed down as a ``JobSpec``.

Three ways a worker starts (``launch.env``), three sources of its job:

- by our agent: the agent names the run directory's resolved job (``job.resolved.yaml``,
  written once by whoever owns the run directory). ``runtime.entry`` parses it, hands the
  spec over here (``hand_over``) and then runs the task loop or the user's script; ``init``
  takes the handed-over spec instead of reading the file again. The harness's job wins over
  a YAML the script names (docs/script-api.md); a ``JobSpec`` passed to ``init`` that
  differs from it is refused with one line.
- by plain torchrun, or as a plain ``python script.py``: the job ``init`` is given (a YAML
  path, or a ``JobSpec``), else the script's job as ``run train.py`` finds it
  (``spec.script_job``: the YAML beside it that names it, else the spec's defaults), with
  ``overrides`` over either.

Torch-free: the entry imports it before the task or the script imports torch.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from elastic_harness import runfiles
from elastic_harness.errors import UsageError
from elastic_harness.launch.env import WorkerEnv
from elastic_harness.spec import JobSpec, dump_job, load_job, parse_job, script_job

_HANDED: tuple[JobSpec, Path] | None = None  # what the entry parsed, for this process's init


def script_flags(argv: Sequence[str], job=None, run_dir=None, overrides: Sequence[str] = ()) -> tuple:
    """Pure: the flags ``init(argv=...)`` reads from a script's command line, ``--job FILE``,
    ``--run-dir DIR`` and ``--set KEY=VALUE`` (repeatable, after ``overrides``), and the rest:
    (job, run_dir, overrides, rest), each flag absent leaving its default. One parser for
    ``python train.py ...`` and ``elastic-harness run train.py ...`` (``commands.jobargs``)."""
    import argparse

    cli = argparse.ArgumentParser(add_help=False)
    cli.add_argument("--job", default=job)
    cli.add_argument("--run-dir", default=run_dir)
    cli.add_argument("--set", action="append", default=list(overrides), metavar="KEY=VALUE")
    known, rest = cli.parse_known_args(list(argv))
    return known.job, known.run_dir, known.set, rest


def hand_over(spec: JobSpec, run_dir: str | Path) -> None:
    """The entry, once: the job our agent named, already parsed, and its run directory."""
    global _HANDED
    _HANDED = (spec, Path(run_dir))


def handed() -> tuple[JobSpec, Path] | None:
    return _HANDED


def resolve_job(env: WorkerEnv, job: str | Path | JobSpec | None, run_dir: str | Path | None,
                overrides: Sequence[str]) -> tuple[JobSpec, Path]:
    """The job and run dir: our agent's (it names them) over the script's arguments.
    Raises ``SpecError`` for a bad YAML or override, ``UsageError`` for a conflicting spec."""
    if env.by_harness:
        spec, where = _HANDED or (load_job(env.job_path), Path(env.run_dir))
        if isinstance(job, JobSpec) and job != spec:
            raise UsageError(
                f"init() was given a JobSpec ('{job.name}') that differs from the job the "
                f"harness resolved for this run ('{spec.name}', {where / runfiles.RESOLVED_SPEC})",
                "pass no job (the harness's job is run.spec), or change the job given to "
                "elastic-harness run")
        return spec, where
    if isinstance(job, JobSpec):
        spec = parse_job(dump_job(job), list(overrides), source=job.name) if overrides else job
    elif job is not None:
        spec = load_job(job, list(overrides))
    elif sys.argv and sys.argv[0].endswith(".py"):  # the rule `run train.py` follows (spec.script_job)
        spec = script_job(sys.argv[0], list(overrides))[0]
    else:
        spec = parse_job("", list(overrides))
    return spec, Path(run_dir) if run_dir is not None else Path("runs") / spec.name
