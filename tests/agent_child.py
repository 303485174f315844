"""An agent for the host zygote tests: ``python -m tests.agent_child ACTION``, forked by a
zygote's ``spawn_agent``.

Adopts the worker zygote forked with it (``Zygote.start``), prints what it found, has that
zygote fork ``tests.zygote_child 3`` and prints the worker's exit code, then exits 7; or,
with ``sleep``, prints its zygote and sleeps until it is killed.
"""

import os
import sys
import time

from elastic_harness.agent.zygote import Zygote
from elastic_harness.launch.env import ZYGOTE_VAR

z = Zygote(preload=())
z.start()
print(f"agent {os.getpid()} zygote {z.pid} var-left {os.environ.get(ZYGOTE_VAR)}", flush=True)
if sys.argv[1] == "sleep":
    time.sleep(600)
pid = z.spawn("tests.zygote_child", ["3"], {"ZYGOTE_TEST": "w", "PATH": os.environ.get("PATH", "")},
              stdout=sys.argv[2], stderr=sys.argv[2] + ".err", unbuffered=True)
while pid not in z.poll(timeout=5.0):
    pass
print(f"worker {pid} exit {z.exits[pid]}", flush=True)
z.stop()
print(f"zygote stopped {z.pid is None}", flush=True)
sys.exit(7)
