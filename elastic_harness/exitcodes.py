"""Exit codes of ``elastic-harness run`` and ``agent``, for people and schedulers.

- ``OK`` (0): the job finished.
- ``FAILED`` (1): it failed and we cannot tell why it would go better next time (workers
  failed more than ``max_restarts`` times without a repeated signature); checkpoints are
  intact. Not retried automatically: look at the logs first.
- ``PERMANENT`` (2): a mistake to fix first, do not retry: a bad job file or argument, an
  incompatible checkpoint, a fatal error in the user's code, a crash loop.
- ``PREEMPTED`` (143 = 128 + SIGTERM; 128 + N for another signal N): stopped by a signal
  after draining; re-running resumes.
- ``INFRA`` (200): the infrastructure failed, retry: too few nodes joined within
  ``rendezvous.join_timeout``, the rendezvous host was lost, a node was cut off from the
  rendezvous. Re-running resumes from the last checkpoint.

Retrying schedulers act on ``retry(code)``: it holds for exactly the preempted and
infrastructure codes. Those are all >= 128 because Kubeflow's ``ExitCode`` restart policy
retries only codes 128..255; ``INFRA`` is above every signal code (128 + 1..64), so it is
never mistaken for one. The sbatch script requeues on the same codes (``lifecycle.slurm``).
"""

OK = 0
FAILED = 1
PERMANENT = 2
PREEMPTED = 143
INFRA = 200

# 128 + signal number (1..64: standard and real-time signals), inclusive bounds
SIGNAL_CODES = (129, 192)
_SIGNALS = range(SIGNAL_CODES[0], SIGNAL_CODES[1] + 1)


def kind(code: int | None) -> str:
    """Pure: 'ok', 'failed', 'permanent', 'preempted' or 'infrastructure' ('' for None)."""
    if code is None:
        return ""
    if code == OK:
        return "ok"
    if code == PERMANENT:
        return "permanent"
    if code == INFRA:
        return "infrastructure"
    if code in _SIGNALS:
        return "preempted"
    return "failed"


def retry(code: int | None) -> bool:
    """Pure: would running the job again be expected to help (preempted or infrastructure)?"""
    return kind(code) in ("preempted", "infrastructure")

