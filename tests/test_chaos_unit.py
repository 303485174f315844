"""Pure decisions: which fault fires where and when, and how failures are explained."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_harness.chaos.schedule import due, fired_by_worker, hits, parse_fault
from elastic_harness.commands.chaos import kubectl_kill_node
from elastic_harness.errors import SpecError
from elastic_harness.launch.agent import explain_rendezvous_error
from elastic_harness.launch.config import NodeOptions
from elastic_harness.launch.isolation import IsolationWatchdog, isolated_for
from elastic_harness.spec import FaultSpec


def test_parse_fault_forms():
    assert parse_fault("kill-worker:1@20") == FaultSpec("kill-worker", 1, at_step=20)
    assert parse_fault("kill-node:2@30s") == FaultSpec("kill-node", 2, at_seconds=30.0)
    assert parse_fault("add-node@100").kind == "add-node"
    with pytest.raises(SpecError, match="not one of"):
        parse_fault("explode:1@3")
    with pytest.raises(SpecError, match="not a step"):
        parse_fault("kill-worker:1@soon")


def test_step_faults_on_processes_fire_in_the_worker_they_hit():
    kill = FaultSpec("kill-worker", 1, at_step=20)
    assert fired_by_worker(kill)
    assert not hits(kill, 19, rank=1, node="0", local_rank=1)
    assert hits(kill, 20, rank=1, node="0", local_rank=1)
    assert hits(kill, 25, rank=1, node="0", local_rank=1), "a resume past the step still fires it"
    assert not hits(kill, 20, rank=0, node="0", local_rank=0)
    node = FaultSpec("kill-node", 1, at_step=5)
    assert hits(node, 5, rank=3, node="1", local_rank=0)
    assert not hits(node, 5, rank=4, node="1", local_rank=1), "one process per node fires it"
    assert not hits(node, 5, rank=0, node="0", local_rank=0)


def test_host_fires_time_faults_and_add_node_once():
    faults = [FaultSpec("kill-worker", 0, at_step=3), FaultSpec("add-node", at_step=10),
              FaultSpec("kill-node", 1, at_seconds=5.0)]
    assert due(faults, set(), step=12, elapsed_s=1.0) == [1]
    assert due(faults, {1}, step=12, elapsed_s=6.0) == [2]
    assert due(faults, {1, 2}, step=50, elapsed_s=60.0) == []


def opts(backend="c10d", is_host=False) -> NodeOptions:
    return NodeOptions(Path("/tmp"), "h:1", "id", backend, 2, 2, 1, 3, is_host=is_host)


def test_rendezvous_errors_are_explained():
    assert "too few nodes" in explain_rendezvous_error("RendezvousTimeoutError", "", opts(), 60)
    assert "rendezvous host lost" in explain_rendezvous_error("RendezvousConnectionError", "", opts(), 60)
    assert "host lost" not in explain_rendezvous_error("RendezvousConnectionError", "x", opts("etcd-v2"), 60)
    assert "closed" in explain_rendezvous_error("RendezvousClosedError", "", opts(), 60)


def test_isolation_decision_and_watchdog():
    assert not isolated_for(last_ok=10.0, now=15.0, limit=6.0)
    assert isolated_for(last_ok=10.0, now=16.5, limit=6.0)
    seen = []
    dog = IsolationWatchdog("10.0.0.1:1", limit=0.05, on_isolated=seen.append, interval=0.01,
                            probe=lambda host, port, timeout: False).start()
    dog._thread.join(timeout=10)
    assert len(seen) == 1 and seen[0] > 0.05


def test_k8s_kill_node_command():
    assert kubectl_kill_node("demo", "ns", 2) == [
        "kubectl", "delete", "pod", "demo-worker-2", "--namespace", "ns", "--grace-period=0", "--wait=false"]


def test_etcd_tls_settings_reach_torchs_rendezvous_conf():
    from elastic_harness.launch.config import rdzv_configs
    from elastic_harness.spec import parse_job

    spec = parse_job("task: {target: 'a.b:C'}\n"
                     "rendezvous: {backend: etcd, endpoint: 'e:2379', etcd_protocol: https, "
                     "etcd_ca_cert: /tls/ca.pem, etcd_cert: /tls/c.pem, etcd_key: /tls/k.pem}")
    conf = rdzv_configs(spec, opts("etcd-v2"))
    assert conf["protocol"] == "https" and conf["ca_cert"] == "/tls/ca.pem"
    assert (conf["ssl_cert"], conf["ssl_cert_key"]) == ("/tls/c.pem", "/tls/k.pem")
    with pytest.raises(SpecError, match="etcd_protocol"):
        parse_job("rendezvous: {etcd_ca_cert: /tls/ca.pem}")
