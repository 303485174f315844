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
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from typing import NoReturn


def exit_without_teardown(code: int) -> NoReturn:
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # closed or broken: nothing to say
                stream.flush()
        os._exit(code)
