"""How a node's agent ends (``agent.node.ending``): the exception that ended it and what the
agent knew then, mapped to its exit code and one line, without a process."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
)

from elastic_harness import exitcodes
from elastic_harness.agent.elastic import GroupLeft
from elastic_harness.agent.node import AgentFacts, ending
from elastic_harness.errors import LockLost
from elastic_harness.launch.config import NodeOptions
from elastic_harness.spec import parse_job
from tests.conftest import MLP

pytestmark = pytest.mark.timeout(60)

SPEC = parse_job(MLP.read_text(), ["max_restarts=3", "restart_window=50", "rendezvous.join_timeout=45"])
FORMED = AgentFacts(formed=True)


def opts(backend: str = "c10d", is_host: bool = False) -> NodeOptions:
    return NodeOptions(Path("/nowhere"), "h:29400", "job-1", backend, 2, 3, 1, 3, is_host=is_host)


def child_failed() -> ChildFailedError:
    return ChildFailedError("entry", {1: ProcessFailure(1, 4242, 7, "/nowhere/error.json")})


def test_a_signal_ends_the_agent_with_128_plus_its_number():
    assert ending(SignalException("got", signal.SIGTERM), FORMED, SPEC, opts()) == (143, "agent received SIGTERM")
    assert ending(SignalException("got", signal.SIGINT), AgentFacts(), SPEC, opts()) == (130, "agent received SIGINT")


def test_a_failed_group_says_why_the_agent_stopped_restarting_in_that_order():
    everything = AgentFacts(formed=True, lost_lock="lock lost", excluded="kept out", stop_reason="crash loop",
                            exhausted="restarts used up")
    for error in (child_failed(), LockLost("lock lost"), GroupLeft("left")):
        assert ending(error, everything, SPEC, opts()) == (exitcodes.PERMANENT, "lock lost")
        no_lock = AgentFacts(formed=True, excluded="kept out", stop_reason="crash loop", exhausted="x")
        assert ending(error, no_lock, SPEC, opts()) == (exitcodes.INFRA, "kept out")
        assert ending(error, AgentFacts(stop_reason="crash loop", exhausted="x"), SPEC, opts()) == \
            (exitcodes.PERMANENT, "crash loop")
        assert ending(error, AgentFacts(exhausted="restarts used up"), SPEC, opts()) == \
            (exitcodes.FAILED, "restarts used up")


def test_a_failed_group_without_a_reason_names_its_first_failure_or_the_error():
    code, line = ending(child_failed(), FORMED, SPEC, opts())
    assert code == exitcodes.FAILED
    assert line.startswith("restarts used up: the workers failed 4 times within 50 steps of progress")
    assert "(max_restarts=3, restart_window=50); last: rank 1 exit 7: " in line
    assert ending(GroupLeft("the group left"), FORMED, SPEC, opts()) == (exitcodes.FAILED, "the group left")
    assert ending(LockLost("taken over"), FORMED, SPEC, opts()) == (exitcodes.FAILED, "taken over")


def test_rendezvous_failures_are_explained_before_and_after_the_first_round():
    code, line = ending(RendezvousTimeoutError("t"), AgentFacts(), SPEC, opts())
    assert code == exitcodes.INFRA and "fewer than nodes.min=2 joined within rendezvous.join_timeout=45s" in line
    code, line = ending(RendezvousConnectionError("refused"), AgentFacts(), SPEC, opts())
    assert code == exitcodes.INFRA and line.startswith("cannot reach the c10d rendezvous at h:29400 (refused)")
    code, line = ending(RendezvousConnectionError("refused"), FORMED, SPEC, opts())
    assert code == exitcodes.INFRA and line.startswith("rendezvous host lost: the c10d store at h:29400")
    assert ending(RendezvousClosedError(), FORMED, SPEC, opts()) == \
        (exitcodes.PERMANENT, "rendezvous 'job-1' is closed (that job already finished); use a new id")
    assert ending(RendezvousGracefulExitError(), FORMED, SPEC, opts()) == \
        (exitcodes.OK, "a spare: the job finished without needing this node")


def test_the_inner_exception_is_the_detail_and_an_etcd_without_v2_is_a_mistake_only_at_start():
    inner = RendezvousConnectionError("see inner exception")
    inner.__cause__ = OSError("Bad response : 404 page not found")
    code, line = ending(inner, AgentFacts(), SPEC, opts("etcd-v2"))
    assert code == exitcodes.PERMANENT and "has no v2 API" in line and "404 page not found" in line
    code, line = ending(inner, FORMED, SPEC, opts("etcd-v2"))
    assert code == exitcodes.INFRA and "RendezvousConnectionError: Bad response : 404" in line


def test_an_exception_that_ends_no_agent_is_left_to_propagate():
    assert ending(ValueError("a bug"), FORMED, SPEC, opts()) is None
    assert ending(KeyError("a bug"), AgentFacts(), SPEC, opts()) is None
