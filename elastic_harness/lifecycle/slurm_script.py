"""Pure: a job -> the sbatch script that runs it on Slurm (``slurm render`` prints it).

The script, top to bottom:

- ``#SBATCH`` lines: ``--nodes=MIN-MAX`` (Slurm allocates within the job's elastic range;
  ``MIN-(MAX+SPARES)`` with hot spares, ``nodes.spares``: the agents' ``--nnodes MIN:MAX``
  keeps an agent beyond ``MAX`` waiting in the rendezvous, a spare that takes a lost node's
  place),
  one task per node (the node's agent starts the workers), ``--requeue``, output appended to
  ``RUN_DIR/logs/slurm-<job id>.out``, and ``--signal=TERM@S`` with S =
  ``timeouts.shutdown_grace`` + a margin: before the time limit Slurm sends SIGTERM to the
  agents, whose workers finish the step and save, so the limit costs no step;
- ``srun`` of ``elastic-harness agent`` on every node of the allocation, each with its log in
  ``RUN_DIR/logs/agent-<node index>.log``; c10d rendezvous on the allocation's first node
  (its agent hosts the store), or the job's etcd; the rendezvous id is the job's id plus
  Slurm's restart count, so a requeued attempt never meets a closed rendezvous;
- a node kept out of the job (``nodes.exclude_after``, ``rendezvous.exclusion``) exits 200 while
  the others go on: when this attempt's events hold the job's ``finish``, the job is done
  (exit 0), not requeued for that node's code;
- requeue: when the agents exit with a code worth a retry (``exitcodes.retry``: preempted
  or infrastructure) and nobody asked to stop the job (``elastic-harness stop`` leaves
  ``RUN_DIR/lifecycle/<id>.stop`` first), ``scontrol requeue`` up to ``max_requeues``
  times; the requeued job resumes from the last checkpoint;
- the batch shell traps SIGTERM (preemption signals it too) so that it outlives the agents'
  drain and reaches the requeue decision; it exits with the agents' code.

The run directory (checkpoints, events, logs) must be on storage every node mounts, and the
interpreter at ``python`` must exist on every node (a shared installation).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from elastic_harness import exitcodes, runfiles
from elastic_harness.errors import HarnessError
from elastic_harness.lifecycle.registry import LIFECYCLE_DIR
from elastic_harness.spec import backends

C10D_PORT = 29400  # torchrun's default
SIGNAL_MARGIN_S = 30  # beyond the drain's own grace: Slurm may signal up to a minute late or early
_TIME = re.compile(r"^(\d+-)?\d+(:\d\d){0,2}$")


@dataclass(frozen=True)
class SlurmOptions:
    partition: str = ""
    time: str = ""  # Slurm's format: MINUTES, HH:MM:SS, D-HH:MM:SS
    account: str = ""
    cpus_per_task: int = 0  # 0: leave it to the cluster's default
    rdzv_port: int = C10D_PORT
    max_requeues: int = 5
    python: str = ""  # the interpreter with elastic_harness installed, on every node
    extra: list = field(default_factory=list)  # more `#SBATCH` options, as given

    def check(self) -> None:
        if self.time and not _TIME.match(self.time):
            raise HarnessError(f"--time '{self.time}' is not a Slurm time",
                               "write MINUTES, HH:MM:SS or D-HH:MM:SS, e.g. --time 2:00:00")
        if not 0 < self.rdzv_port < 65536:
            raise HarnessError(f"--rdzv-port {self.rdzv_port} is not a port", "pick 1..65535")
        if self.max_requeues < 0 or self.cpus_per_task < 0:
            raise HarnessError("--max-requeues and --cpus-per-task cannot be negative", "use 0 or more")
        bad = [x for x in self.extra if not str(x).startswith("--")]
        if bad:
            raise HarnessError(f"--sbatch '{bad[0]}' is not an sbatch option", "write it as --option=value")


@dataclass(frozen=True)
class ScriptJob:
    """What the script runs: the job file agents load, its run dir, and its id."""

    name: str
    job_file: str
    run_dir: str
    job_id: str  # "" = the name plus Slurm's job id (a script submitted by hand)
    workdir: str  # the directory relative task modules and paths are found from
    overrides: tuple = ()  # --set KEY=VALUE the agents apply to job_file


def render(spec, job: ScriptJob, options: SlurmOptions) -> str:
    """The sbatch script (module doc). Raises ``HarnessError`` for an etcd job without an
    endpoint: the nodes would have nowhere to meet."""
    options.check()
    row = backends.BY_NAME[spec.rendezvous.backend]
    if not row.hosts_store and not spec.rendezvous.endpoint:
        raise HarnessError(f"rendezvous.backend is {row.name} but rendezvous.endpoint is empty",
                           f"set rendezvous.endpoint to HOST:{row.port} of an etcd every node reaches")
    spaced = [p for p in (job.run_dir, job.workdir) if any(c.isspace() for c in p)]
    if spaced:
        raise HarnessError(f"'{spaced[0]}' has white space, which #SBATCH lines cannot carry",
                           "use a run directory (and working directory) without spaces")
    q = shlex.quote
    lines = ["#!/bin/bash", f"# elastic-harness job {spec.name}: generated by `elastic-harness slurm render`",
             *(f"#SBATCH {opt}" for opt in _sbatch_options(spec, job, options)),
             "", "set -u", f"RUN_DIR={q(job.run_dir)}", f"JOB_FILE={q(job.job_file)}",
             f"JOB_ID={q(job.job_id) if job.job_id else q(spec.name) + '-slurm$SLURM_JOB_ID'}",
             f"PY={q(options.python)}", "ATTEMPT=${SLURM_RESTART_COUNT:-0}",
             f'STOP_FILE="$RUN_DIR/{LIFECYCLE_DIR}/$JOB_ID.stop"',
             "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONUNBUFFERED=1",
             "trap 'echo \"batch: SIGTERM; the agents drain and save\"' TERM",
             f'mkdir -p "$RUN_DIR/{runfiles.LOGS}"', *_rendezvous(spec, options),
             '[ -e "$STOP_FILE" ] && { echo "batch: stop requested before the agents started"; exit 143; }', "",
             f'EVENTS="$RUN_DIR/{runfiles.EVENTS}"', 'EVENTS_AT=$(stat -c %s "$EVENTS" 2>/dev/null || echo 0)',
             *_srun(spec, job), "code=$?", "", *_kept_out(), "", *_requeue(options), "exit $code", ""]
    return "\n".join(lines)


def _sbatch_options(spec, job: ScriptJob, o: SlurmOptions) -> list[str]:
    n = spec.nodes
    most = n.max + n.spares  # hot spares: agents beyond nodes.max (module doc)
    opts = [f"--job-name={spec.name}", f"--nodes={n.min}" if n.min == most else f"--nodes={n.min}-{most}",
            "--ntasks-per-node=1", "--requeue", "--open-mode=append",
            f"--output={job.run_dir}/{runfiles.LOGS}/slurm-%j.out", f"--chdir={job.workdir}",
            f"--signal=TERM@{spec.timeouts.shutdown_grace + SIGNAL_MARGIN_S}"]
    if spec.device == "cuda":
        opts.append(f"--gpus-per-node={spec.nproc_per_node}")
    for flag, value in (("partition", o.partition), ("time", o.time), ("account", o.account)):
        if value:
            opts.append(f"--{flag}={value}")
    if o.cpus_per_task:
        opts.append(f"--cpus-per-task={o.cpus_per_task}")
    return [*opts, *map(str, o.extra)]


def _rendezvous(spec, o: SlurmOptions) -> list[str]:
    if backends.BY_NAME[spec.rendezvous.backend].hosts_store:
        return ['HOST0=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                f'ENDPOINT="$HOST0:{o.rdzv_port}"  # the first node\'s agent hosts the c10d store']
    return [f"ENDPOINT={shlex.quote(spec.rendezvous.endpoint)}"]


def _srun(spec, job: ScriptJob) -> list[str]:
    sets = " ".join(f"--set {shlex.quote(str(o))}" for o in job.overrides)
    # --submission: the Slurm job is the submission, so another one that pinned the same
    # rendezvous id is refused by the run dir's lock, not joined (a requeue is the same job).
    agent = ['"$PY" -m elastic_harness agent "$JOB_FILE" --run-dir "$RUN_DIR" --job-id "$JOB_ID"'
             ' --submission "slurm-$SLURM_JOB_ID"',
             f'--rdzv-backend {spec.rendezvous.backend} --rdzv-endpoint "$ENDPOINT" --rdzv-id "$JOB_ID-$ATTEMPT"',
             f"--nnodes {spec.nodes.min}:{spec.nodes.max} --nproc-per-node {spec.nproc_per_node} "
             f"--max-restarts {spec.max_restarts}", *([sets] if sets else [])]
    srun = ['srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --kill-on-bad-exit=0',
            f'--output="$RUN_DIR/{runfiles.LOGS}/{runfiles.agent_log("%n")}" --open-mode=append']
    parts = [*srun, *agent]
    return [("  " if i else "") + part + (" \\" if i < len(parts) - 1 else "") for i, part in enumerate(parts)]


def _kept_out() -> list[str]:
    """A node kept out exits 200 (``exitcodes.INFRA``) and srun returns the highest code:
    a job that finished without it is done (module doc)."""
    return [
        f"# a node kept out of the job exits {exitcodes.INFRA}; the job may have finished without it",
        f'if [ "$code" -eq {exitcodes.INFRA} ] && tail -c +"$((EVENTS_AT + 1))" "$EVENTS" 2>/dev/null '
        """| grep -q '"event": "finish"'; then""",
        f'  echo "batch: the job finished; a node that left it exited {exitcodes.INFRA}: done, not requeued"',
        "  code=0",
        "fi",
    ]


def _requeue(o: SlurmOptions) -> list[str]:
    lo, hi = exitcodes.SIGNAL_CODES
    return [
        f"# requeue on a preempted ({lo}..{hi}) or infrastructure ({exitcodes.INFRA}) exit, unless stopped",
        f'if [ "$code" -eq {exitcodes.INFRA} ] || {{ [ "$code" -ge {lo} ] && [ "$code" -le {hi} ]; }}; then',
        '  if [ -e "$STOP_FILE" ]; then',
        '    echo "batch: agents exited $code after a stop request: not requeued"',
        f'  elif [ "$ATTEMPT" -lt {o.max_requeues} ]; then',
        '    echo "batch: agents exited $code: requeueing (attempt $ATTEMPT)"',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "  else",
        f'    echo "batch: agents exited $code: {o.max_requeues} requeues used, giving up"',
        "  fi",
        "fi",
    ]
