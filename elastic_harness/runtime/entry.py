"""Process entry for a worker: arm the parent-death signal before importing anything heavy.

torchelastic starts each worker in its own session, so killing an agent's process group
does not reach its workers; without this, a SIGKILLed agent leaves orphans training at the
old world size. Importing torch takes seconds, so the signal is armed first.
"""

import ctypes
import signal
import sys


def die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: SIGKILL us when the agent dies
    except OSError:
        pass


if __name__ == "__main__":
    die_with_parent()
    from elastic_harness.runtime.worker import main

    sys.exit(main(sys.argv[1:]))
