"""A worker for the zygote tests: ``python -m tests.zygote_child ACTION``.

Prints the ``ZYGOTE_TEST`` variable and its arguments, registers an ``atexit`` line, then
exits with the code ACTION names, or sleeps (``sleep``) until it is signalled.
"""

import atexit
import os
import sys
import time

print(os.environ.get("ZYGOTE_TEST"), sys.argv[1:], f"parent={os.getppid()}", flush=True)
atexit.register(lambda: print("atexit ran", flush=True))
if sys.argv[1] == "sleep":
    time.sleep(600)
sys.exit(int(sys.argv[1]))
