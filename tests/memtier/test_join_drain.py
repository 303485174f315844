"""A drain only for a node joining keeps the state in memory, not storage (issue 26), and
everything else still saves to storage: the worker's signals (``session.Drain``), the
collective agreement at the drain step (``StepHook._join_snapshot``, one real gloo rank),
which layouts qualify (``resume.memory_covers_join``), and the agent's wait for drained
workers (``elastic.workers_exited``). The e2e side: ``test_e2e_cluster`` (a DDP join
writes no storage checkpoint and resumes from ``peer``; a preemption still saves)."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elastic_harness.agent.elastic import JOIN_SIGNAL, workers_exited
from elastic_harness.checkpoint.entries import EXTRA_PREFIX
from elastic_harness.runtime import session
from elastic_harness.runtime.hook import Keeping, Reporting, Signals, StepHook, Trained
from elastic_harness.runtime.resume import memory_covers_join
from elastic_harness.runtime.topology import Topology

pytestmark = pytest.mark.timeout(60)

DDP, FSDP = Topology.build(4, 2, 2, "ddp"), Topology.build(4, 2, 2, "fsdp")
MESH = Topology.build(4, 2, 2, {"shard": 2, "tensor": 1})


def test_the_join_signal_drains_without_stopping_and_any_sigterm_makes_it_a_stop():
    assert session.JOIN_SIGNAL is JOIN_SIGNAL, "the agent and its workers name the same signal"
    drain = session.Drain()
    try:
        os.kill(os.getpid(), JOIN_SIGNAL)
        assert (drain.requested, drain.stop) == (True, False)
        os.kill(os.getpid(), signal.SIGTERM)  # preemption during a join's drain: storage
        assert (drain.requested, drain.stop) == (True, True)
    finally:
        drain.restore()
    assert signal.getsignal(JOIN_SIGNAL) is signal.SIG_DFL


def test_a_join_drain_is_taken_once_and_a_stop_is_never_taken_for_one():
    """A worker kept in place keeps its ``Drain`` into the next generation: the join it parked
    for must not drain its next step again (that was one more round, and the joined node's
    worker restarted). A stop is no join: it is not taken, and stays."""
    drain = session.Drain()
    try:
        os.kill(os.getpid(), JOIN_SIGNAL)
        assert drain.take_join()
        assert (drain.requested, drain.take_join()) == (False, False), "taken once: the next step trains on"
        os.kill(os.getpid(), JOIN_SIGNAL)
        os.kill(os.getpid(), signal.SIGTERM)
        assert not drain.take_join()
        assert (drain.requested, drain.stop) == (True, True), "a stop stays for the drain that saves it"
    finally:
        drain.restore()


class FakeTier:
    def __init__(self, saves: bool) -> None:
        self.saves, self.saved = saves, []

    def save(self, step, state, *, send=False, settled=False):
        self.saved.append((step, send))
        return self.saves


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def hook(memory, covered: bool) -> StepHook:
    taken = []
    cadence = SimpleNamespace(taken=taken.append)
    h = StepHook(None, SimpleNamespace(rank=0, world_size=1, dp_degree=1, ranks_per_share=1),
                 Trained({"x": 1}, None), Keeping(None, memory, cadence, join_in_memory=covered),
                 Signals(lambda: True), Reporting(None, None))
    h.taken = taken
    return h


def test_a_join_drain_stays_in_memory_only_when_every_rank_snapshotted(one_rank):
    tier = FakeTier(saves=True)
    h = hook(tier, covered=True)
    assert h._join_snapshot(7) is True
    assert tier.saved == [(7, False)] and h.taken == [7], "forced, no buddy send: the drain waits for nothing"
    # the slot could not be written (still being sent, the tier failed): storage as before
    assert hook(FakeTier(saves=False), covered=True)._join_snapshot(7) is False
    # a layout memory does not cover, or the tier off: no snapshot tried, storage
    untried = FakeTier(saves=True)
    assert hook(untried, covered=False)._join_snapshot(7) is False and untried.saved == []
    assert hook(None, covered=True)._join_snapshot(7) is False


def test_a_stop_is_what_the_drain_flag_says_unless_told_apart():
    """Built without ``stop_requested`` (a caller that knows no join signal), every drain is a stop."""
    assert hook(None, covered=True).signals.stop() is True


def test_ddp_fsdp_and_mesh_layouts_restore_a_join_from_memory():
    tier = object()
    plain = nn.Linear(2, 2)
    state = {"model": 1, "optimizer": 2, "train": 3}
    assert memory_covers_join(tier, plain, state, topology=FSDP)
    assert not memory_covers_join(tier, plain, state, topology=DDP), "a bare model is not a DDP replica"
    assert memory_covers_join(tier, plain, state, topology=MESH), "HSDP/TP: a replica sends each coordinate"
    assert not memory_covers_join(tier, plain, {**state, f"{EXTRA_PREFIX}rng": torch.zeros(1)}, topology=MESH)
    assert not memory_covers_join(None, plain, state, topology=FSDP), "the tier off: storage"
    extra = {**state, f"{EXTRA_PREFIX}rng": torch.zeros(1)}
    assert not memory_covers_join(tier, plain, extra, topology=FSDP), "per-rank entries: storage"


def test_the_agent_sees_drained_workers_without_reaping_them_as_failures():
    class Warm:
        nprocs = 2

        def __init__(self, codes):
            self.codes = codes

        def _codes(self):
            return self.codes

    assert not workers_exited(Warm({0: 143}))
    assert workers_exited(Warm({0: 143, 1: 143}))
    running = SimpleNamespace(proc=SimpleNamespace(poll=lambda: None))
    done = SimpleNamespace(proc=SimpleNamespace(poll=lambda: 143))
    assert not workers_exited(SimpleNamespace(subprocess_handlers={0: done, 1: running}))
    assert workers_exited(SimpleNamespace(subprocess_handlers={0: done, 1: done}))
