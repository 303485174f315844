"""A worker for the control-channel test: ``python -m tests.control_child``.

Reads orders from its agent through ``runtime.control`` and answers each ``reform`` with a
``reformed`` naming the RANK it was given, until the agent says ``exit``."""

import os
import sys

from elastic_harness.runtime.control import Control

control = Control.from_environ(os.environ)
if control is None:
    print("no control channel", flush=True)
    sys.exit(3)
left = []
control.on_leave = lambda reason, remote: left.append([reason, remote])
control.start()
control.tell("parked", step=7)
while True:
    order = control.await_order(30)
    if order["op"] != "reform":
        break
    control.tell("reformed", rank=order["env"]["RANK"], left=left)
sys.exit(0 if order["op"] == "exit" else 4)
