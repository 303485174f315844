"""Pure decisions: which fault fires where and when, and how failures are explained."""

from __future__ import annotations

import argparse
import signal
import threading
import typing
from pathlib import Path

import pytest

from elastic_harness import exitcodes
from elastic_harness.agent.isolation import (
    IsolationWatchdog,
    etcd_members,
    exit_isolated,
    isolated_for,
)
from elastic_harness.agent.node import explain_rendezvous_error
from elastic_harness.chaos.inject import ChaosController, ready
from elastic_harness.chaos.schedule import due, hits, unfired
from elastic_harness.chaos.vocabulary import (
    FIRE_NOW_S,
    KINDS,
    check_netns,
    check_targets,
    fault_text,
    fire_now,
    fired_by_worker,
    parse_fault,
)
from elastic_harness.cli import main
from elastic_harness.commands.chaos import cmd_chaos, kubectl_kill_node
from elastic_harness.errors import HarnessError, SpecError
from elastic_harness.events import EventLog, read_events
from elastic_harness.launch.config import NodeOptions
from elastic_harness.runtime.faults import WorkerFaults, children_of, node_processes, recipient
from elastic_harness.spec import FaultSpec
from tests.conftest import MLP
from tests.servers import etcd_cluster, free_port, wait_until


def test_parse_fault_forms():
    assert parse_fault("kill-worker:1@20") == FaultSpec("kill-worker", 1, at_step=20)
    assert parse_fault("kill-node:2@30s") == FaultSpec("kill-node", 2, at_seconds=30.0)
    assert parse_fault("add-node@100").kind == "add-node"
    with pytest.raises(SpecError, match="not one of"):
        parse_fault("explode:1@3")
    with pytest.raises(SpecError, match="not a step"):
        parse_fault("kill-worker:1@soon")
    assert parse_fault("heal:1") == FaultSpec("heal", 1, at_seconds=FIRE_NOW_S), "no '@' means now"
    assert parse_fault("kill-worker:1@2.5s").at_seconds == 2.5


@pytest.mark.parametrize("text, words", [
    ("kill-worker:one@20", "target 'one' is not a rank number"),
    ("kill-worker:-1@5", "target '-1'"),
    ("kill-worker:@5", "target ''"),
    ("kill-worker:1:2@3", "target '1:2'"),
    ("kill-node:²@3", "is not a node number"),
    ("add-node:2@5", "add-node takes no target"),
    ("kill-worker:1@", "'@' is not a step"),
    ("kill-worker:1@0", "'@0' is not a step"),
    ("kill-worker:1@-5", "'@-5'"),
    ("kill-worker:1@1.5", "'@1.5'"),
    ("kill-worker:1@s", "'@s'"),
    ("kill-worker:1@nans", "'@nans'"),
    ("kill-worker:1@20@30", "'@20@30'"),
    ("kill-worker:1@20\n", "'@20\\n'"),
    ("", "kind '' is not one of"),
])
def test_malformed_fault_strings_are_refused_in_one_line(text, words):
    with pytest.raises(SpecError) as caught:
        parse_fault(text)
    message = str(caught.value)
    assert words in message and "\n  fix: " in message
    assert message.count("\n") == 1, "one line for the problem, one for the fix"


def test_the_vocabulary_and_the_spec_name_the_same_kinds():
    assert set(KINDS) == set(typing.get_args(typing.get_type_hints(FaultSpec)["kind"]))
    for kind in KINDS.values():
        assert (kind.how == "signal") == (kind.signal is not None) == bool(kind.reaches)
        assert not kind.worker_fires or kind.reaches in ("rank", "agent", "agent-group"), \
            "a worker can signal only itself or its agent"


def test_the_fault_table_in_the_docs_names_every_kind():
    rows = [line for line in (Path(MLP).parents[1] / "docs" / "faults.md").read_text().splitlines()
            if line.startswith("| `")]
    named = {part.split(":")[0].strip("` ") for row in rows for part in row.split("|")[1].split("/")}
    assert set(KINDS) <= named


def test_netns_rule_and_targets_are_checked_in_one_place():
    cut = FaultSpec("partition", 1, at_step=5)
    check_netns([cut], netns=True)
    with pytest.raises(HarnessError, match="need simulated hosts") as caught:
        check_netns([FaultSpec("kill-worker", 0, at_step=1), cut], netns=False)
    assert "--netns" in caught.value.hint
    check_targets([FaultSpec("kill-worker", 3, at_step=1), FaultSpec("kill-node", 2, at_step=1)], ranks=4, nodes=3)
    with pytest.raises(HarnessError, match="rank 4, but this job has ranks 0..3"):
        check_targets([FaultSpec("kill-worker", 4, at_step=1)], ranks=4, nodes=3)
    with pytest.raises(HarnessError, match="node 3"):
        check_targets([FaultSpec("preempt", 3, at_step=1)], ranks=4, nodes=3)


def test_who_a_fault_reaches():
    assert recipient(FaultSpec("kill-worker", 1, at_step=2), pid=50, parent=40) == (50, "rank 1")
    assert recipient(FaultSpec("kill-node", 0, at_step=2), pid=50, parent=40) == (40, "node 0's agent")
    assert KINDS["kill-node"].signal == signal.SIGKILL and KINDS["preempt"].signal == signal.SIGTERM
    workers = {0: (10, "0"), 1: (11, "1")}
    assert ready(FaultSpec("hang", 1, at_seconds=1), workers, nodes={0, 1})
    assert not ready(FaultSpec("hang", 2, at_seconds=1), workers, nodes={0, 1}), "rank 2 not started"
    assert not ready(FaultSpec("kill-node", 2, at_seconds=1), workers, nodes={0, 1}), "node 2 not added yet"
    assert not ready(FaultSpec("hang-node", 2, at_seconds=1), workers, nodes={0, 1, 2}), "its workers unknown"
    assert ready(FaultSpec("add-node", at_seconds=1), {}, nodes={0})
    requested = fire_now(FaultSpec("kill-worker", 1, at_step=40))
    assert requested.at_seconds == FIRE_NOW_S and not fired_by_worker(requested)


def test_a_node_kill_lists_the_agent_then_everything_under_it_then_the_firing_worker():
    tree = {40: [41, 99], 41: [50, 51], 50: [], 51: [], 99: []}  # agent 40, zygote 41, workers 50, 51
    assert node_processes(40, 50, tree.__getitem__) == [40, 41, 99, 51, 50]
    assert node_processes(40, 50, lambda _pid: []) == [40, 50]  # no listing: PDEATHSIG does the rest


def test_a_worker_fired_node_kill_ends_the_whole_node_at_once(tmp_path, monkeypatch):
    """``kill-node`` fired by a node's worker SIGKILLs its agent, the processes under it and
    itself, not only the agent (the rest used to follow one parent's exit at a time)."""
    import os
    import subprocess
    import sys

    from elastic_harness.runtime import faults as faults_module

    # A stand-in node: an "agent" with a "zygote" child, which has a "worker" child.
    agent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run([sys.executable, '-c', "
                              "'import subprocess, sys; subprocess.run([\"sleep\", \"120\"])'])"],
                             start_new_session=True)
    try:
        wait_until(lambda: len(_descendants(agent.pid)) == 2, 30, "the stand-in node's processes")
        zygote, sleeper = _descendants(agent.pid)
        firing = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        faults = WorkerFaults([FaultSpec("kill-node", 1, at_step=3)], rank=1, node="1", local_rank=0,
                              marker_dir=tmp_path / "chaos", events=EventLog(tmp_path / "events.jsonl"),
                              agent=agent.pid)
        ends = node_processes(agent.pid, firing.pid, children_of)
        assert ends == [agent.pid, zygote, sleeper, firing.pid]
        faults.after_step(2)  # not yet
        assert agent.poll() is None
        pids = {agent.pid, zygote, sleeper}
        assert faults_module.own_proc()  # this machine's /proc numbers processes as we do
        monkeypatch.setattr(faults_module, "own_proc", lambda: True)
        monkeypatch.setattr(os, "getpid", lambda: firing.pid)  # the firing worker: SIGKILLs itself last
        faults.after_step(3)
        monkeypatch.undo()
        assert agent.wait(30) == -signal.SIGKILL and firing.wait(30) == -signal.SIGKILL
        wait_until(lambda: not any(_alive(p) for p in pids), 30, "every process of the node to end")
        event = read_events(tmp_path / "events.jsonl")[-1]
        assert event["detail"] == f"SIGKILL node 1's agent and its workers (pid {agent.pid})"
    finally:
        os.killpg(agent.pid, signal.SIGKILL)  # its session: only what this test started
        agent.wait()


def _descendants(pid: int) -> list[int]:
    out, queue = [], [pid]
    while queue:
        for child in children_of(queue.pop(0)):
            out.append(child)
            queue.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_run_refuses_a_malformed_fault_before_starting_anything(tmp_path, capsys):
    # In-process through the CLI's own entry (what `python -m elastic_harness` calls).
    code = main(["run", str(MLP), "--chaos", "kill-worker:one@20", "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "target 'one' is not a rank number" in err
    assert err.count("\n") == 2 and "\n  fix: " in err, "one line, then the fix"
    assert not (tmp_path / "run").exists(), "nothing was started or written"


def chaos_args(run_dir: Path, fault: str) -> argparse.Namespace:
    return argparse.Namespace(k8s=False, target=str(run_dir), fault=fault)


def test_chaos_command_refuses_timed_and_link_faults_it_cannot_fire(tmp_path):
    EventLog(tmp_path / "events.jsonl").emit("start", who="host", nodes=1, netns=False)
    with pytest.raises(HarnessError, match="fires now, it takes no '@'"):
        cmd_chaos(chaos_args(tmp_path, "kill-worker:1@20"))
    with pytest.raises(HarnessError, match="need simulated hosts"):
        cmd_chaos(chaos_args(tmp_path, "partition:1"))
    assert not (tmp_path / "chaos").exists(), "nothing was requested"
    assert cmd_chaos(chaos_args(tmp_path, "kill-worker:1")) == 0
    assert len(list((tmp_path / "chaos" / "requests").glob("*.json"))) == 1


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
    assert not isolated_for(last_ok=None, now=1e9, limit=6.0), "never reached: not isolated"
    answers = iter([False] * 30 + [True])  # the rendezvous host starts late, then is lost
    probed, seen = [], []
    dog = IsolationWatchdog("10.0.0.1:1", limit=0.05, on_isolated=seen.append, interval=0.01,
                            probe=lambda host, port, timeout: probed.append(host) or next(answers, False))
    dog.start()._thread.join(timeout=30)
    assert len(seen) == 1 and seen[0] > 0.05
    assert len(probed) > 31, "the 30 failed probes before the first success started no clock"


def test_isolation_probes_every_etcd_member():
    """Member 1 of 3 (the configured endpoint) is lost; the others still answer."""
    alive = {"10.0.0.1": 3, "10.0.0.2": 10**6, "10.0.0.3": 10**6}  # successes left per member
    rounds, seen = [], []

    def probe(host: str, port: int, timeout: float) -> bool:
        if host == "10.0.0.1":
            rounds.append(1)
            if len(rounds) >= 40:
                dog.stop()
        alive[host] -= 1
        return alive[host] >= 0

    members = ["10.0.0.1:2379", "10.0.0.2:2379", "10.0.0.3:2379"]
    dog = IsolationWatchdog("10.0.0.1:2379", limit=0.05, on_isolated=seen.append, interval=0.01,
                            probe=probe, members=lambda: members).start()
    dog._thread.join(timeout=30)
    assert seen == [] and dog.endpoints == members and len(rounds) >= 40


def test_an_isolated_agent_exits_even_when_the_run_dir_hangs(tmp_path):
    codes: list[int] = []
    log = EventLog(tmp_path / "events.jsonl")
    exit_isolated(log, "1", "h:1", exit=codes.append)(7.0)
    assert codes == [exitcodes.INFRA] and [e["event"] for e in read_events(log.path)] == ["isolated", "exit"]

    class HungStorage:
        def __init__(self) -> None:
            self.release = threading.Event()

        def emit(self, kind: str, **fields) -> None:
            self.release.wait(60)

    hung = HungStorage()
    try:
        exit_isolated(hung, "1", "h:1", write_budget_s=0.1, exit=codes.append)(7.0)
        assert codes == [exitcodes.INFRA] * 2, "it exits after the budget, the write still hanging"
    finally:
        hung.release.set()


@pytest.mark.timeout(120)
def test_etcd_members_lists_what_the_cluster_advertises(tmp_path):
    assert etcd_members(f"127.0.0.1:{free_port()}", timeout=0.5) == []
    with etcd_cluster(tmp_path) as members:
        assert sorted(etcd_members(members[0][0])) == sorted(e for e, _ in members)


def test_k8s_kill_node_command():
    assert kubectl_kill_node("demo", "ns", 2) == [
        "kubectl", "delete", "pod", "demo-worker-2", "--namespace", "ns", "--grace-period=0", "--wait=false"]


def test_etcd_tls_settings_reach_torchs_rendezvous_conf():
    from elastic_harness.launch.config import rdzv_configs
    from elastic_harness.spec import parse_job

    spec = parse_job("task: {target: 'a.b:C'}\n"
                     "rendezvous: {backend: etcd, endpoint: 'e:2379', etcd_protocol: https, "
                     "etcd_ca_cert: /tls/ca.pem, etcd_cert: /tls/c.pem, etcd_key: /tls/k.pem}")
    for backend in ("etcd-v3", "etcd-v2"):
        conf = rdzv_configs(spec, opts(backend))
        assert conf["protocol"] == "https" and conf["ca_cert"] == "/tls/ca.pem"
        assert (conf["ssl_cert"], conf["ssl_cert_key"]) == ("/tls/c.pem", "/tls/k.pem")
    auth = parse_job("task: {target: 'a.b:C'}\nrendezvous: {backend: etcd, etcd_user: job, "
                     "etcd_password_file: /secret/pw}")
    conf = rdzv_configs(auth, opts("etcd-v3"))
    assert (conf["user"], conf["password_file"]) == ("job", "/secret/pw"), "a path, never the password"
    for text, field in (("{backend: etcd, etcd_user: job}", "etcd_user"),
                        ("{backend: etcd, etcd_password_file: /pw}", "etcd_password_file"),
                        ("{backend: etcd-v2, etcd_user: job, etcd_password_file: /pw}", "etcd_user")):
        with pytest.raises(SpecError, match=field):
            parse_job(f"rendezvous: {text}")
    with pytest.raises(SpecError, match="etcd_protocol"):
        parse_job("rendezvous: {etcd_ca_cert: /tls/ca.pem}")


def test_a_fault_after_the_last_step_is_refused():
    check_targets([FaultSpec("kill-worker", 1, at_step=60)], ranks=2, nodes=1, steps=60)
    with pytest.raises(HarnessError, match="kill-worker:1@500' is keyed to step 500, but this job trains 60") as e:
        check_targets([FaultSpec("kill-worker", 1, at_step=500)], ranks=2, nodes=1, steps=60)
    assert "from 1 to 60" in e.value.hint


def test_run_refuses_a_fault_beyond_train_steps_before_starting(tmp_path, capsys):
    code = main(["run", str(MLP), "--set", "train.steps=60", "--chaos", "kill-worker:1@500",
                 "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "never fire" in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize("text", ["kill-worker:1@500", "add-node@100", "kill-node:2@30s", "hang:0@2.5s"])
def test_fault_text_reads_back(text):
    assert fault_text(parse_fault(text)) == text


def test_unfired_faults_and_unjoined_nodes_are_named(tmp_path):
    faults = [parse_fault("kill-worker:1@20"), parse_fault("kill-worker:1@500"), parse_fault("add-node@10")]
    fired = [{"event": "fault", "kind": "kill-worker", "target": 1, "step": 20},
             {"event": "fault", "kind": "add-node", "target": 0, "step": 10}]
    assert unfired(faults, fired) == [1], "each event accounts for one fault"
    chaos = ChaosController(faults, EventLog(tmp_path / "events.jsonl"), tmp_path)
    for e in [{"event": "worker", "rank": 0, "pid": 5, "node": "0"},
              {"event": "worker", "rank": 1, "pid": 6, "node": "1"}, *fired]:
        chaos.observe(e, cluster=None)
    assert chaos.unfired() == [faults[1]]
    (tmp_path / "chaos").mkdir()
    (tmp_path / "chaos" / "fault-1").touch()  # a worker fired it in an earlier run of this dir
    assert chaos.unfired() == []
    assert chaos.unjoined([0, 1, 2]) == [2], "node 2 started but no worker of it reported"
    chaos.observe({"event": "worker", "rank": 1, "pid": 7, "node": "0"}, cluster=None)  # node 1 left
    assert chaos.unjoined([0, 1, 2]) == [2], "node 1 was part of the job once"
