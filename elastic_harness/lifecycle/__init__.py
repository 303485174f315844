"""Job lifecycle: submit a job, ask how it is doing, read its logs, stop it.

One ``Scheduler`` per place a job can run: ``local`` (a detached supervisor on this
machine, ``lifecycle.local``), ``slurm`` (an sbatch script, ``lifecycle.slurm``) and ``k8s``
(manifests applied with kubectl, ``lifecycle.kube``). The commands ``submit``, ``status``,
``list``, ``logs`` and ``stop`` (``commands/submit.py``, ``commands/jobs.py``) are the same for
all three. The interface is ``api.Scheduler``; ``schedulers.scheduler_for`` picks one.
Each scheduler owns its flags of ``submit``, its line of ``submit --help`` and its part of
the job record (``JobRecord.details``): adding one is its module here and one line in
``schedulers.SCHEDULERS``.

Call order, per job:

1. ``check()``: the scheduler's own commands are present (``sbatch``, a kubectl context);
   raises ``HarnessError`` naming what is missing. Nothing has been created yet.
2. ``submit(submission)`` once: starts the job detached and returns its ``JobRecord``, which
   the caller saves in the registry (``registry.save``) before printing the id.
3. ``status(record)`` any number of times: a ``state.JobStatus`` (never raises because the
   job is gone; it says so).
4. ``logs(record, query, out)``: writes the merged logs; follows them with ``query.follow``
   until the job ends or the reader is interrupted.
5. ``stop(record, now)``: graceful by default (every rank finishes its step, saves
   synchronously, exits); ``now=True`` kills. The caller first records the stop request
   (``registry.request_stop``) and then waits with ``status`` until the job is no longer
   active. ``stop`` of a job that is not active is refused by the caller, not here.

Records live in the registry (``registry``: ``$ELASTIC_HARNESS_STATE_DIR`` or
``~/.local/state/elastic-harness``); jobs started by ``run`` register themselves too, so
``status`` and ``list`` see them. Pure parts: ``state`` (the state decision),
``slurm_script`` (the sbatch script), ``kubectl`` (commands and the parsing of kubectl's
JSON), ``logsource`` (which files hold which node's and rank's logs).
"""
