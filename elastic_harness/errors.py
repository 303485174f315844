"""One exception hierarchy for mistakes a user can fix.

Every ``HarnessError`` carries a one-line message naming the problem and a ``hint`` naming
the fix. The CLI prints exactly that and exits non-zero; tracebacks go to the run's log.
``assert`` is kept for our own invariants. This module imports nothing of ours, so every
layer (the pure ``spec`` included) may raise these.
"""

from __future__ import annotations


class HarnessError(Exception):
    """A problem the user can fix. ``exit_code`` is what the CLI returns for it."""

    exit_code = 2

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message}\n  fix: {self.hint}" if self.hint else self.message


class SpecError(HarnessError):
    """The job YAML is malformed or a value is out of range. ``path`` is the dotted key."""

    def __init__(self, path: str, message: str, hint: str = "") -> None:
        where = f"{path}: " if path else ""
        super().__init__(f"job spec error: {where}{message}", hint)
        self.path = path


class SpecErrors(SpecError):
    """Several mistakes in one job spec, each with its path and fix (``errors``), printed as
    one line each so a user fixes them all in one go."""

    def __init__(self, errors: list[SpecError]) -> None:
        super().__init__("", f"{len(errors)} problems")
        self.errors = errors
        self.path = errors[0].path

    def __str__(self) -> str:
        lines = [self.message]
        for e in self.errors:
            where = f"{e.path}: " if e.path else ""
            text = e.message.removeprefix("job spec error: ").removeprefix(where)
            lines.append(f"  {where}{text}" + (f" (fix: {e.hint})" if e.hint else ""))
        return "\n".join(lines)


class TaskError(HarnessError):
    """The task named by ``task.target`` cannot be imported or built."""


class UsageError(HarnessError):
    """The public API (``elastic_harness.init`` and friends) was called the wrong way."""


class RunDirError(HarnessError):
    """The run directory cannot be created or written."""


class LockLost(RunDirError):
    """Another live job took this submission's run directory over (``checkpoint.lock``):
    it must stop without saving."""


class CheckpointError(HarnessError):
    """A checkpoint cannot be written, read, or does not belong to this job."""


class ClusterError(HarnessError):
    """The job could not keep enough nodes, or lost its rendezvous host."""

    exit_code = 1


class Preempted(ClusterError):
    """The job was stopped by a signal after draining; re-running resumes it."""

    exit_code = 143


def os_reason(e: OSError) -> str:
    """The system's words for ``e`` ("Permission denied"), or the exception itself when it
    has none. (Messages used to put ``e.strerror or e!r`` in an f-string, and ``!r`` applies
    to the whole expression: the words came out quoted.)"""
    return e.strerror or repr(e)

