"""End a process that has torch loaded without the interpreter's teardown.

With torch imported, Python's own shutdown (freeing every module and its objects) takes
about a second on a quiet 2-core machine and several on a loaded one, and whoever waits for
the process pays it: an agent waits for a failed worker before restarting the group, a
host for its agents before it can report, a user for the host. ``exit_without_teardown``
runs the ``atexit`` callbacks (loggers flush there), flushes the standard streams and ends
the process with ``os._exit``. Threads still running are not waited for, so it is only for
processes whose work is done and recorded: a worker whose failure is logged
(``runtime.failures``), the zygote, and the ``run``/``agent`` commands once they returned
their exit code (``cli.entry``).

Of the exit callbacks, one is itself teardown: torch registers an exit-time finalizer for
each of its operator libraries (``torch.library``: some 200 once torch is imported), which
unregisters the library's operators from the dispatcher. That is 25-110 ms of a failed
worker's exit on a 2-core machine with 8 ranks on it, every rank in turn, as a node loss
reaches them through their collectives (each hop of that chain waited for it).
``run_exit_callbacks`` detaches those and runs the rest (loggers, temp directories, the
worker's own ``close``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import weakref
from typing import NoReturn

# The module whose exit-time finalizers only undo process state (``run_exit_callbacks``).
TEARDOWN_ONLY = ("torch.library",)


def drop_teardown_finalizers() -> int:
    """Detach the exit-time finalizers of ``TEARDOWN_ONLY`` (module doc); how many. Every
    other finalizer is left to run."""
    dropped = 0
    for fin in list(getattr(weakref.finalize, "_registry", {})):
        found = fin.peek()
        if found is not None and fin.atexit and getattr(found[1], "__module__", None) in TEARDOWN_ONLY:
            fin.detach()
            dropped += 1
    return dropped


def run_exit_callbacks() -> None:
    """The ``atexit`` callbacks, less torch's teardown-only finalizers (module doc)."""
    drop_teardown_finalizers()
    atexit._run_exitfuncs()


def exit_without_teardown(code: int) -> NoReturn:
    try:
        run_exit_callbacks()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # closed or broken: nothing to say
                stream.flush()
        os._exit(code)
