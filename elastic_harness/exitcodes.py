"""Exit codes of ``elastic-harness run`` and ``agent``, for people and schedulers.

- ``OK`` (0): the job finished.
- ``FAILED`` (1): it failed in a way a retry may fix (restarts used up, rendezvous host
  lost, too few nodes within ``rendezvous.join_timeout``); checkpoints are intact.
- ``PERMANENT`` (2): a mistake to fix first, do not retry: a bad job file or argument, an
  incompatible checkpoint, a fatal error in the user's code, a crash loop.
- ``PREEMPTED`` (143 = 128 + SIGTERM): stopped by a signal after draining; re-running
  resumes. Kubeflow's ExitCode policy retries codes >= 128.
"""

OK = 0
FAILED = 1
PERMANENT = 2
PREEMPTED = 143
