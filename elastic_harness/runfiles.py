"""The run directory's names: every file and folder a run keeps there, spelled once.

Pure names and nothing else (no imports), so every layer can use it: the host, the agent,
the worker, the checkpoint code and the pure deciders below them. ``rundir`` claims and
prepares a run directory; ``checkpoint.where`` says where checkpoints live; this module only
says what each thing in the directory is called::

    runs/<job>/
      job.resolved.yaml   RESOLVED_SPEC  the spec actually used (written once, by the owner)
      job.key             KEY            the job's key (``jobkey``), unless provided from outside
      .elastic-harness.lock  LOCK        who holds the directory (``checkpoint.lock``); the same
                                         name holds an outside checkpoint directory
      checkpoints/        CHECKPOINTS    the default checkpoint root (``checkpoint.where``)
      events.jsonl        EVENTS         one line per event (``events.CONTRACT``)
      summary.json        SUMMARY        the run's summary (``summary``)
      logs/               LOGS           agent and worker logs
      samples/            SAMPLES        per-rank sample records (``train.record_samples``)
      tensorboard/        TENSORBOARD    TensorBoard files (``metrics.tensorboard``)
      chaos/              CHAOS          markers of faults that fired (``chaos.inject``)
      cache/ tmp/         CACHE, TMP     torch's caches and the watchdog FIFOs (``launch.scratch``)
      lifecycle/          LIFECYCLE      a submission's stop request, Slurm script, frozen job
"""

RESOLVED_SPEC = "job.resolved.yaml"
KEY = "job.key"
LOCK = ".elastic-harness.lock"
CHECKPOINTS = "checkpoints"
EVENTS = "events.jsonl"
SUMMARY = "summary.json"
LOGS = "logs"
SAMPLES = "samples"
TENSORBOARD = "tensorboard"
CHAOS = "chaos"
CACHE = "cache"
TMP = "tmp"
REPORT_PLOT = "report.png"
LIFECYCLE = "lifecycle"  # submissions: stop requests, the Slurm script and its frozen job

# What ``--fresh`` moves aside (``NAME.old-STAMP``) besides the checkpoints: a run's own record.
SET_ASIDE_ON_FRESH = (EVENTS, SUMMARY, SAMPLES)


def fault_marker(index: int) -> str:
    """The marker of chaos fault ``index`` (the job's list order) once it fired, under ``CHAOS``:
    a step-keyed fault fires once per run directory (``runtime.faults``)."""
    return f"fault-{index}"


def agent_log(node: int | str) -> str:
    """A simulated node's agent log, under ``LOGS``."""
    return f"agent-{node}.log"
