"""Simulated multi-node jobs: each node is a real elastic agent process with its own workers.

The job is the MLP made heavy enough (a step takes tens of ms) for membership changes to
land mid-run. Faults are keyed by step and each test asserts they actually fired.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from elastic_harness import exitcodes
from tests.audit import audit
from tests.conftest import MLP, REPO, cli, final_ckpt, model_of, read_jsonl
from tests.e2e.test_e2e_core import assert_close
from tests.lanes import DETECTION
from tests.servers import etcd_cluster, etcd_server, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420), DETECTION]

STEPS, G = 300, 30
HEAVY = ["--set", "task.args.dim=256", "--set", "task.args.hidden=1024", "--set", "task.args.depth=3",
         "--set", "optimizer.lr=0.001", "--set", f"train.steps={STEPS}", "--set", "train.record_samples=true",
         "--nproc-per-node", "1"]
ELASTIC = ["--set", "nodes.min=1", "--set", "nodes.max=2"]


@pytest.fixture(scope="module")
def heavy_reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("heavy-ref")
    r = cli("run", str(MLP), "--nodes", "2", *ELASTIC, *HEAVY, run_dir=run_dir)
    assert r.code == 0, r.err
    return r


def fault_kinds(r) -> list[str]:
    return [f["kind"] for f in r.kinds("fault")]


def test_node_loss_shrinks_and_new_node_grows(heavy_reference, tmp_path):
    r = cli("run", str(MLP), "--nodes", "2", *ELASTIC, *HEAVY,
            "--chaos", "kill-node:1@30", "--chaos", "add-node@100", run_dir=tmp_path)
    assert r.code == 0, r.err
    assert fault_kinds(r) == ["kill-node", "add-node"]
    gens = r.kinds("rendezvous")
    assert [g["world_size"] for g in gens] == [2, 1, 2], r.timeline()
    # Scale-up is a membership change, not a failure: no restart is spent on it.
    assert gens[2]["restart"] == gens[1]["restart"] == gens[0]["restart"] + 1
    # In place both times: the survivor of the loss keeps its process, and at the join it
    # parks after its drained step instead of exiting, then runs its loop beside the newcomer.
    survivor = {e["rank"]: e["pid"] for e in r.kinds("worker") if e["restart"] == 0}[0]
    loss, join = r.kinds("recovery")
    assert (loss["kept"], loss["new"], join["kept"], len(join["new"])) == ([survivor], [], [survivor], 1)
    assert join["mode"] == "rerun"
    (drain,) = r.kinds("drain")
    assert r.kinds("resume")[-1]["step"] == drain["step"], "scale-up must lose no step"
    # A drain only for a join, under DDP: a forced snapshot in memory, no storage write
    # (a checkpoint at that step only if the periodic one fell due there: every 10 steps).
    assert drain["saved"] == "memory"
    at_drain = [c for c in r.kinds("checkpoint") if c["step"] == drain["step"]]
    assert not at_drain or drain["step"] % 10 == 0, at_drain
    # DDP: the survivor finishes the step in flight at world size 1 (no restore); at the
    # scale-up the new node's rank receives the drained state from the survivor's
    # (memtier.peer): no storage read.
    (finished,) = r.kinds("finished")
    assert (finished["step"], finished["lost_dp_ranks"]) == (31, [1])
    fresh, after_join = r.kinds("resume")
    assert fresh["fresh"] and after_join["step"] == drain["step"]
    assert (after_join["source"], after_join["receivers"], len(after_join["senders"])) == ("peer", 1, 1)
    seen = audit(tmp_path, 1024, G, STEPS)
    assert set(seen["world_sizes"].values()) == {1, 2}
    diff = assert_close(model_of(final_ckpt(tmp_path)), model_of(final_ckpt(heavy_reference.run_dir)))
    print(f"shrink+grow vs uninterrupted: {diff}")


def test_preempted_node_drains_with_zero_lost_steps(tmp_path):
    r = cli("run", str(MLP), "--nodes", "2", *ELASTIC, *HEAVY, "--set", "train.steps=120",
            "--chaos", "preempt:1@40", run_dir=tmp_path)
    assert r.code == 0, r.err
    assert fault_kinds(r) == ["preempt"]
    (drain,) = r.kinds("drain")
    assert drain["step"] >= 40
    assert drain["saved"] == "storage", "a preemption always saves to storage"
    resumed = r.kinds("resume")[-1]
    assert resumed["step"] == drain["step"] and resumed["world_size"] == 1
    exits = {e["node"]: e["code"] for e in r.kinds("exit") if e.get("who") == "agent"}
    assert exits == {"1": 143, "0": 0}, "a preempted agent exits 128+15 so schedulers retry it"
    audit(tmp_path, 1024, G, 120)


def test_below_min_nodes_fails_clearly_keeps_checkpoints_and_resumes(tmp_path):
    fixed = ["--set", "nodes.min=2", "--set", "nodes.max=2", "--set", "rendezvous.join_timeout=6"]
    r = cli("run", str(MLP), "--nodes", "2", *fixed, *HEAVY, "--set", "train.steps=80",
            "--chaos", "kill-node:1@25", run_dir=tmp_path)
    assert r.code == exitcodes.INFRA, r.err  # the infrastructure's failure: worth a retry
    assert "too few nodes" in r.err and "nodes.min=2" in r.err and "Traceback" not in r.err
    assert fault_kinds(r) == ["kill-node"]
    saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*/manifest.json"))
    assert saved, "earlier checkpoints must survive the failed job"
    again = cli("run", str(MLP), "--nodes", "2", *fixed, *HEAVY, "--set", "train.steps=80", run_dir=tmp_path)
    assert again.code == 0, again.err
    assert again.kinds("resume")[0]["step"] >= 10
    audit(tmp_path, 1024, G, 80)


def test_losing_the_c10d_host_is_explained_and_rerun_resumes(tmp_path):
    r = cli("run", str(MLP), "--nodes", "2", *ELASTIC, *HEAVY, "--set", "train.steps=80",
            "--chaos", "kill-node:0@25", run_dir=tmp_path)
    assert r.code == exitcodes.INFRA, r.err
    assert "rendezvous host lost" in r.err and "etcd" in r.err
    first_id = r.kinds("start")[0]["run_id"]
    again = cli("run", str(MLP), "--nodes", "2", *ELASTIC, *HEAVY, "--set", "train.steps=80", run_dir=tmp_path)
    assert again.code == 0, again.err
    assert again.kinds("start")[0]["run_id"] != first_id, "a new rendezvous id per submission"
    assert again.kinds("resume")[0]["step"] >= 10


def test_etcd_rendezvous_survives_losing_node_zero(tmp_path):
    with etcd_server(tmp_path / "etcd-data") as endpoint:
        r = cli("run", str(MLP), "--nodes", "2", *ELASTIC, *HEAVY, "--set", "train.steps=120",
                "--set", "rendezvous.backend=etcd", "--set", f"rendezvous.endpoint={endpoint}",
                "--chaos", "kill-node:0@30", run_dir=tmp_path / "run")
    assert r.code == 0, r.err
    assert fault_kinds(r) == ["kill-node"]
    assert [g["world_size"] for g in r.kinds("rendezvous")] == [2, 1]
    audit(tmp_path / "run", 1024, G, 120)


def test_three_member_etcd_survives_losing_a_member(tmp_path):
    """Kill one of three etcd members (v2 API off: the v3 backend) mid-training, then lose a
    node: the re-rendezvous after the node loss runs on the two remaining members (quorum)
    and the job finishes. The member killed is the one the agents talk to (named first in
    the endpoint): their clients fail over to the next."""
    (tmp_path / "etcd").mkdir()
    run_dir = tmp_path / "run"
    with etcd_cluster(tmp_path / "etcd") as members:
        endpoint = ",".join(e for e, _ in members)
        cmd = [sys.executable, "-m", "elastic_harness", "run", str(MLP), "--run-dir", str(run_dir),
               "--nodes", "2", *ELASTIC, *HEAVY, "--set", "train.steps=200",
               "--set", "rendezvous.backend=etcd", "--set", f"rendezvous.endpoint={endpoint}",
               "--chaos", "kill-node:1@80"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=REPO, start_new_session=True)
        try:
            steps = lambda: [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "step"]  # noqa: E731
            wait_until(lambda: len(steps()) >= 20 or proc.poll() is not None, 180, "step 20")
            killed = members[0][1]
            killed.kill()
            killed.wait()
            out, err = proc.communicate(timeout=240)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert proc.returncode == 0, err
    events = read_jsonl(run_dir / "events.jsonl")
    kill_t = max(e["t"] for e in steps_of(events)[:20])
    assert [e["kind"] for e in events if e["event"] == "fault"] == ["kill-node"]
    sizes = [(e["t"] > kill_t, e["world_size"]) for e in events if e["event"] == "rendezvous"]
    assert sizes[-1] == (True, 1), "a rendezvous after the member loss formed the smaller group"
    audit(run_dir, 1024, G, 200)


def steps_of(events: list[dict]) -> list[dict]:
    return [e for e in events if e["event"] == "step"]


def test_frozen_node_is_dropped_by_the_watchdog_and_keep_alives(tmp_path):
    r = cli("run", str(MLP), "--nodes", "2", *ELASTIC, *HEAVY, "--set", "train.steps=200",
            "--set", "timeouts.step=5", "--set", "timeouts.shutdown_grace=5",
            "--chaos", "hang-node:1@40", run_dir=tmp_path)
    assert r.code == 0, r.err
    (fault,) = r.kinds("fault")
    assert fault["kind"] == "hang-node" and "SIGSTOP node 1" in fault["detail"]
    gens = r.kinds("rendezvous")
    assert gens[0]["world_size"] == 2 and gens[-1]["world_size"] == 1
    audit(tmp_path, 1024, G, 200)
