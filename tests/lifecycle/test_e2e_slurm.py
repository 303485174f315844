"""A job on a real Slurm (``tests/slurm.py``: munged, slurmctld and three slurmd on this
machine, each node in network and UTS namespaces of its own): submitted, followed, preempted
the way Slurm signals a job before its time limit (SIGTERM to the job's steps) and requeued
by its script, stopped gracefully, submitted again, and finished with the same model as the
uninterrupted reference run.

The job is the MLP reference job on two nodes with one worker each (world size 2, as the
reference: the same model bit for bit), with a synchronous checkpoint after every step (no
effect on the parameters; slow enough steps to interrupt). The c10d store is on the first
node at an OS-picked port.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from elastic_harness.lifecycle.slurm import parse_scontrol
from tests.conftest import MLP, cli, read_jsonl
from tests.lanes import DETECTION
from tests.lifecycle.test_e2e_lifecycle import SLOW, steps_of
from tests.servers import free_port, wait_until
from tests.slurm import slurm_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600), DETECTION]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    with slurm_cluster(tmp_path_factory.mktemp("slurm"), nodes=3) as env:
        yield env


def events_of(run_dir, kind: str) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == kind]


def test_submit_preempt_requeue_stop_resubmit_and_finish(slurm, mlp_reference, tmp_path):
    run_dir = tmp_path / "run"
    two = ["--set", "nodes.min=2", "--set", "nodes.max=2", "--nproc-per-node", "1"]
    common = ["--scheduler", "slurm", "--run-dir", str(run_dir), "--rdzv-port", str(free_port()), *two, *SLOW]
    eh = lambda *args, timeout=120: cli(*args, timeout=timeout, env=slurm)  # noqa: E731
    r = eh("submit", str(MLP), *common, "--json")
    assert r.code == 0, r.err
    sub = json.loads(r.out)
    job, slurm_job = sub["id"], sub["slurm_job"]
    try:
        wait_until(lambda: len(steps_of(run_dir, job)) >= 3, 300, "the Slurm job to train")
        st = json.loads(eh("status", job, "--json").out)
        assert (st["state"], st["where"], st["world_size"], st["nodes"]) == \
            ("running", f"Slurm job {slurm_job}: RUNNING", 2, 2)
        workers = {e["node"]: e["rank"] for e in events_of(run_dir, "worker")}
        assert workers == {"0": 0, "1": 1}, "rank 0 on the first node, whose agent hosts the store"

        # What --signal=TERM@S does before the time limit: SIGTERM to the job's steps (the agents).
        subprocess.run(["scancel", "--signal=TERM", slurm_job], env={**os.environ, **slurm}, check=True, timeout=30)
        wait_until(lambda: len(events_of(run_dir, "resume")) == 2, 300, "the requeued attempt to resume")
        drain, resumed = events_of(run_dir, "drain")[-1], events_of(run_dir, "resume")[-1]
        assert resumed["step"] == drain["step"], "the drained step was saved: nothing lost to the preemption"
        shown = parse_scontrol(subprocess.run(["scontrol", "show", "job", "--oneliner", slurm_job], env={**os.environ, **slurm},
                                              capture_output=True, text=True, timeout=30).stdout)
        assert shown["Restarts"] == "1" and shown["JobState"] == "RUNNING"

        stop = eh("stop", job, timeout=300)
        assert stop.code == 0, stop.err
        stopped = json.loads(eh("status", job, "--json").out)
        k = stopped["last_checkpoint_step"]
        assert (stopped["state"], stopped["exit_code"], stopped["recoveries"]) == ("stopped", 143, 1)
        assert stop.out.strip() == f"{job} stopped: on request; drained and saved at step {k}" and k > drain["step"]
        logs = eh("logs", job).out.splitlines()
        assert "[batch] batch: agents exited 143: requeueing (attempt 0)" in logs
        assert "[batch] batch: agents exited 143 after a stop request: not requeued" in logs
        for node in ("0", "1"):  # an agent per node and attempt, each in its node's log
            header = f"[node {node} agent] === elastic-harness agent: node {node}, job {job}"
            assert sum(line.startswith(header) for line in logs) == 2, node
    finally:
        eh("stop", "--now", job, timeout=120)

    again = eh("submit", str(MLP), *common, "--json")
    assert again.code == 0, again.err
    last, last_slurm = json.loads(again.out)["id"], json.loads(again.out)["slurm_job"]
    try:
        wait_until(lambda: events_of(run_dir, "finish"), 300, "the resubmitted job to finish")
        done = json.loads(eh("status", last, "--json").out)
        assert (done["state"], done["step"]) == ("succeeded", 60), done
        assert done["model_digest"] == mlp_reference.summary["model_digest"], "the same model as never stopped"
        # The batch job ends by itself, exit 0, not requeued (and the fixture has nothing to cancel).
        show = lambda: parse_scontrol(subprocess.run(  # noqa: E731
            ["scontrol", "show", "job", "--oneliner", last_slurm], env={**os.environ, **slurm},
            capture_output=True, text=True, timeout=30).stdout)
        wait_until(lambda: show().get("JobState") not in ("RUNNING", "COMPLETING"), 120, "the batch job to end")
        assert (show()["JobState"], show()["ExitCode"], show()["Restarts"]) == ("COMPLETED", "0:0", "0")
    finally:
        eh("stop", "--now", last, timeout=120)


def test_a_spare_is_one_more_node_and_a_node_kept_out_does_not_requeue_the_finished_job(slurm, tmp_path):
    """`nodes.spares: 1` asked Slurm for the nodes 0 spares ask for: no spare. Now three nodes
    are allocated for two, and the third agent waits as a spare. Rank 1 hangs; the watchdog
    stops it and its node is kept out (nodes.exclude_after=1: exit 200); the spare takes its
    place at world size 2, and the job finishes. srun returns the kept-out node's 200, which
    requeued the finished job: the batch script now sees the job's finish and exits 0."""
    run_dir = tmp_path / "run"
    eh = lambda *args, timeout=120: cli(*args, timeout=timeout, env=slurm)  # noqa: E731
    r = eh("submit", str(MLP), "--scheduler", "slurm", "--run-dir", str(run_dir), "--rdzv-port", str(free_port()),
           "--set", "nodes.min=2", "--set", "nodes.max=2", "--set", "nodes.spares=1", "--nproc-per-node", "1",
           "--set", "nodes.exclude_after=1", "--set", "timeouts.step=5", "--set", "train.steps=40",
           "--chaos", "hang:1@5", "--json")
    assert r.code == 0, r.err
    sub = json.loads(r.out)
    show = lambda: parse_scontrol(subprocess.run(  # noqa: E731
        ["scontrol", "show", "job", "--oneliner", sub["slurm_job"]], env={**os.environ, **slurm},
        capture_output=True, text=True, timeout=30).stdout)
    try:
        script = (run_dir / "lifecycle" / f"{sub['id']}.sbatch").read_text()
        assert "#SBATCH --nodes=2-3" in script and "--nnodes 2:2" in script
        wait_until(lambda: show().get("JobState") not in ("PENDING", "RUNNING", "COMPLETING", "REQUEUED", None),
                   400, "the batch job to end")
        assert (show()["JobState"], show()["ExitCode"], show()["Restarts"]) == ("COMPLETED", "0:0", "0"), show()
    finally:
        eh("stop", "--now", sub["id"], timeout=120)
    starts = {e["node"] for e in events_of(run_dir, "start") if e.get("who") == "agent"}
    assert starts == {"0", "1", "2"}, "an agent on each of the three nodes"
    (out,) = events_of(run_dir, "excluded")
    sizes = [e["world_size"] for e in events_of(run_dir, "rendezvous")]
    assert sizes[0] == 2 and sizes[-1] == 2, "the spare took the kept-out node's place"
    assert events_of(run_dir, "finish")[-1]["step"] == 40
    later = {e["node"] for e in events_of(run_dir, "worker") if e["t"] > out["t"]}
    assert out["node"] not in later and len(later) == 2
    assert "done, not requeued" in (run_dir / "logs" / f"slurm-{sub['slurm_job']}.out").read_text()
