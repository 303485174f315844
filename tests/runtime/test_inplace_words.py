"""The order of a survivor's words to its agent (``runtime.inplace.Recovery``).

A collective that fails on a backend's thread makes the worker say ``broken`` and leave its
groups; leaving lets the training thread park and say ``parked``. The agent keeps a worker
once it said ``parked`` and drops what it said before; a ``broken`` that came after would be
heard once the next group started, and would break that group (CI: the kept worker's
replacement was killed, and the job ran out of restarts). So ``broken`` is said before the
groups are left, and never once the worker parked."""

from __future__ import annotations

import json
import socket
import threading

import pytest

from elastic_harness.runtime import generations
from elastic_harness.runtime.control import Control
from elastic_harness.runtime.inplace import Parked, Recovery

pytestmark = pytest.mark.timeout(30)


def _said(sock: socket.socket) -> list[str]:
    """The ops waiting on the agent's end, without blocking."""
    ops = []
    while True:
        try:
            ops.append(json.loads(sock.recv(1 << 20))["op"])
        except BlockingIOError:
            return ops


class _Seen(generations.Generations):
    """Real generations that note what the agent had heard when they were left."""

    def __init__(self, agent: socket.socket) -> None:
        super().__init__(rank=0, world_size=1, timeout_s=5)
        self.agent, self.heard_at_leave = agent, None

    def leave(self, reason, spare=()):
        self.heard_at_leave = _said(self.agent)
        super().leave(reason, spare)


@pytest.fixture()
def line():
    agent, worker = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    agent.setblocking(False)
    yield agent, worker
    agent.close()
    worker.close()


def test_a_failed_collective_is_said_before_the_groups_are_left(line):
    agent, worker = line
    gens = _Seen(agent)
    recovery = Recovery(Control(worker), gens, 5.0)
    recovery._broke("connection reset by peer")
    assert gens.heard_at_leave == ["broken"]


def test_a_parked_worker_says_nothing_of_a_collective_that_fails_late(line):
    agent, worker = line
    recovery = Recovery(Control(worker).start(), _Seen(agent), 5.0)
    ended: list[BaseException] = []

    def park():
        try:
            recovery.park(step=7, kept=None)
        except Parked as e:
            ended.append(e)

    parker = threading.Thread(target=park)
    parker.start()
    agent.setblocking(True)
    assert json.loads(agent.recv(1 << 20))["op"] == "parked"
    agent.setblocking(False)
    recovery._broke("connection reset by peer")  # the old generation's backend, after parking
    agent.send(json.dumps({"op": "exit"}).encode())
    parker.join(10)
    assert ended and _said(agent) == []
