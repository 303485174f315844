"""Process entry for a worker our agent starts: arm the parent-death signal, then run the
job's task loop (``runtime.worker``) or the user's script (``script.path``).

torchelastic starts each worker in its own session, so killing an agent's process group
does not reach its workers; without ``PR_SET_PDEATHSIG``, a SIGKILLed agent leaves orphans
training at the old world size. Importing torch takes seconds, so the signal is armed first.
With warm starts (``runtime.zygote``) this module runs in a fork of the agent's zygote: the
parent is the zygote, which itself dies with the agent, and torch is already imported.

An exception that escapes is printed (the traceback goes to the worker's log first: the
event below makes the host stop everything when it is fatal), recorded as a ``failure``
event (with the signature the agent uses to detect a crash loop, see ``runtime.failures``)
and then re-raised through torchelastic's ``@record``, which writes the traceback to the
agent's error file.
``SystemExit`` (a drain exits 143) and ``KeyboardInterrupt`` pass through unrecorded. A
failed (or drained) worker then exits at once (``failures.exit_now``): its agent is waiting
for that exit to restart the group, and Python's own teardown with torch loaded takes
seconds.

The job is parsed here, once per process, and handed down (``runtime.jobsource``): the task
loop gets the ``JobSpec``, the user's script's ``init()`` takes it without reading the file.

Usage: ``python -m elastic_harness.runtime.entry JOB_YAML RUN_DIR``.
"""

import ctypes
import signal
import sys

from elastic_harness import runfiles


def die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: SIGKILL us when the agent dies
    except OSError:
        pass


def run_script(path: str, args: list[str]) -> int:
    """Run the user's script as ``__main__`` with its arguments, like ``python path args``."""
    import os
    import runpy

    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    runpy.run_path(path, run_name="__main__")
    return 0


def run_job(job_path: str, run_dir: str) -> int:
    """The job's one parse in this process, handed down: the user's script, or the task loop.
    In place (``runtime.inplace``), the training function may run again in this process,
    beside the new workers of a re-formed generation: after a ``Rerun``, or after an exception
    that escaped it while its generation was broken (a collective's failure reached the
    script's own code), once this process took its next place."""
    from elastic_harness.spec import load_job

    spec = load_job(job_path)
    while True:
        try:
            return _run_once(spec, run_dir)
        except BaseException as e:  # noqa: BLE001 - only a rerun is handled; the rest goes on up
            if not _runs_again(e, spec):
                raise


def _runs_again(exc: BaseException, spec) -> bool:
    """After ``exc`` left the training function: does it run again in this process? A
    ``Rerun`` (re-formed already), or an ``Exception`` while the generation is broken: this
    process then parks and re-forms first (``runtime.inplace``)."""
    from elastic_harness.runtime import inplace, session

    recovery = inplace.current()
    if recovery is None or recovery.underway:  # the in-place path itself failed: go down
        return False
    if isinstance(exc, Exception) and recovery.broken() is not None:
        run = session.active()
        step = run.step if run is not None else 0
        if run is not None and not run.closed:
            run.close()
        recovery.reform(recovery.park(step, None), spec)
        return True
    if isinstance(exc, inplace.Rerun):
        run = session.active()
        if run is not None and not run.closed:
            run.close()
        return True
    return False


def _run_once(spec, run_dir: str) -> int:
    from elastic_harness.runtime import jobsource

    jobsource.hand_over(spec, run_dir)  # the script's init() takes it from there
    if spec.script.path:
        from elastic_harness.launch.env import WorkerEnv
        from elastic_harness.runtime.dist import serve_for_script

        # rank 0's store on MASTER_ADDR, also for a script's own init_process_group
        serve_for_script(WorkerEnv.from_environ(standalone_ok=True), spec.timeouts.process_group)
        return run_script(spec.script.path, [str(a) for a in spec.script.args])
    from elastic_harness.runtime.worker import main as task_main

    return task_main(spec, run_dir)


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import record

    job_path, run_dir = argv[:2]

    @record
    def guarded() -> int:
        try:
            return run_job(job_path, run_dir)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as e:
            # The traceback reaches the log before the event does: a fatal event makes the
            # host stop every agent at once, and a worker stopped before it printed (or
            # before @record wrote the error file) would leave no trace of where it failed.
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
            _record(e, run_dir)
            raise

    try:
        return guarded()
    except Exception:  # printed and recorded (event, torchelastic's error file): restart now
        from elastic_harness.runtime.failures import exit_now

        exit_now(1, printed=True)
        raise  # not reached
    except SystemExit as e:  # a drain (143): its save is done, its agent waits for the exit
        if e.code not in (None, 0):
            from elastic_harness.runtime.failures import exit_now

            exit_now(e.code if isinstance(e.code, int) else 1)
        raise


def _record(exc: BaseException, run_dir: str) -> None:
    """The failure, with the step of the active run when there is one."""
    from pathlib import Path

    from elastic_harness.events import EventLog
    from elastic_harness.launch.env import WorkerEnv
    from elastic_harness.runtime import failures, session

    run = session.active()
    if run is not None:
        run.record_failure(exc)
        return
    env = WorkerEnv.from_environ(standalone_ok=True)
    failures.record(EventLog(Path(run_dir) / runfiles.EVENTS), exc,
                    failures.Who(env.rank, env.node, env.restart_count), step=None)


if __name__ == "__main__":
    die_with_parent()
    sys.exit(main(sys.argv[1:]))
