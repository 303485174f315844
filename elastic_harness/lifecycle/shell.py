"""Run a scheduler's command (sbatch, squeue, kubectl...) with a bound and a clear error.

``need`` is what ``Scheduler.check`` calls: a missing command is one ``HarnessError``
naming it and how to get it. ``run`` never raises for a non-zero exit (callers decide what
an exit means: ``squeue`` of a finished job fails, for one); it raises only when the command
cannot be started or does not answer within ``timeout_s``.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence

from elastic_harness.errors import HarnessError


def need(command: str, what: str, fix: str) -> str:
    """The path of ``command``, or a ``HarnessError``: '<command> not found ...'."""
    path = shutil.which(command)
    if path is None:
        raise HarnessError(f"{command} not found on PATH: {what}", fix)
    return path


def which(command: str) -> bool:
    return shutil.which(command) is not None


def run(cmd: Sequence[str], timeout_s: float = 60.0, stdin: str | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout_s, input=stdin,
                              check=False)
    except FileNotFoundError:
        raise HarnessError(f"{cmd[0]} not found on PATH", f"install it, or check PATH ({cmd[0]} is "
                           "needed for this scheduler)") from None
    except subprocess.TimeoutExpired:
        raise HarnessError(f"`{' '.join(cmd[:3])} ...` did not answer within {timeout_s:.0f} s",
                           "check that the scheduler is reachable, then try again") from None


def first_line(result: subprocess.CompletedProcess) -> str:
    """The first non-empty line of stderr (else stdout): what a failed command said."""
    for text in (result.stderr, result.stdout):
        for line in (text or "").splitlines():
            if line.strip():
                return line.strip()
    return f"exit {result.returncode}"
