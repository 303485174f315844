"""Hot spares and bad nodes (issue 36, item 4): bad input and the pure rules."""

from __future__ import annotations

import pytest

from elastic_harness.chaos.vocabulary import parse_fault
from elastic_harness.commands.support.spares import Spares, check, faults_on_spares
from elastic_harness.errors import HarnessError, SpecError
from elastic_harness.rendezvous import exclusion
from elastic_harness.spec import parse_job
from tests.conftest import MLP

pytestmark = pytest.mark.timeout(60)


def test_spares_while_the_job_could_grow_are_refused_in_one_line():
    with pytest.raises(HarnessError) as e:
        check(1, nodes=2, max_nodes=3)
    assert "would join the job as one more node" in e.value.message and "--nodes 3" in e.value.hint
    check(1, nodes=3, max_nodes=3)
    check(0, nodes=2, max_nodes=3)


def test_more_spares_than_the_job_can_hold_is_a_spec_error():
    with pytest.raises(SpecError) as e:
        parse_job(MLP.read_text(), ["nodes.max=2", "nodes.spares=3"])
    assert "nodes.spares" in str(e.value) and "at most 2" in str(e.value)
    assert parse_job(MLP.read_text(), ["nodes.max=2", "nodes.spares=2"]).nodes.spares == 2


def test_a_fault_aimed_at_a_spare_is_named():
    faults = [parse_fault("kill-node:2@40"), parse_fault("kill-node:1@40"), parse_fault("kill-worker:2@40")]
    (line,) = faults_on_spares(faults, nodes=2, spares=1)
    assert "kill-node:2@40" in line and "node 2, a spare" in line


def test_run_refuses_spares_below_nodes_max_before_starting_anything(cli_here):
    r = cli_here("run", str(MLP), "--nodes", "1", "--set", "nodes.max=2", "--set", "nodes.spares=1")
    assert r.code == 2 and "a spare would join the job as one more node" in r.err
    assert "Traceback" not in r.err


class Cluster:
    def __init__(self) -> None:
        self.added: list[int] = []

    def add_node(self, index: int) -> None:
        self.added.append(index)


class Log:
    def __init__(self) -> None:
        self.emitted: list[tuple] = []

    def emit(self, kind: str, **fields) -> None:
        self.emitted.append((kind, fields))


def test_spares_start_once_the_group_formed_and_a_spare_that_ended_unjoined_is_named():
    said: list[str] = []
    spares, cluster, log = Spares(2, 3, say=said.append), Cluster(), Log()
    spares.observe({"event": "step"}, cluster, log)
    assert cluster.added == []
    spares.observe({"event": "rendezvous", "world_size": 3}, cluster, log)
    spares.observe({"event": "rendezvous", "world_size": 3}, cluster, log)
    assert cluster.added == [3, 4] and log.emitted == [("spares", {"nodes": ["3", "4"], "world_size": 3})]
    spares.watch({3: 200, 4: None}, joined={"0", "1", "2"})
    spares.watch({3: 200, 4: 0}, joined={"0", "1", "2"})
    assert len(said) == 1 and "spare node 3 ended (exit 200)" in said[0]
    spares.watch({4: 1}, joined={"4"})
    assert len(said) == 1, "a spare that joined and later ended is no spare that never joined"


def test_a_node_is_kept_out_after_enough_failures_within_the_window():
    assert exclusion.counted([0.0, 50.0, 700.0], now=710.0, window_s=600.0) == 1
    assert exclusion.out([100.0, 400.0], now=500.0, limit=2, window_s=600.0)
    assert not exclusion.out([100.0, 400.0], now=800.0, limit=2, window_s=600.0)
    assert not exclusion.out([1.0, 2.0, 3.0], now=3.0, limit=0, window_s=600.0), "0: never"
    now = [0.0]
    strikes = exclusion.Strikes(2, 600.0, clock=lambda: now[0])
    strikes.add("dropped")
    assert strikes.verdict("1") is None
    now[0] = 300.0
    strikes.add("rank 1 hung (it was stopped by a signal)")
    message = strikes.verdict("1")
    assert message.startswith("node 1 kept out") and "dropped; rank 1 hung" in message
