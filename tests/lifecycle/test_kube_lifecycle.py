"""Kubernetes jobs through kubectl: the commands built, and what kubectl's JSON means.

No cluster runs here. The scheduler takes its command runner as an argument; these tests
give it one that records each command (and what went to its stdin) and answers with JSON
written from the Kubernetes API's documented shapes (PodList, StatefulSet, Kubeflow's
PyTorchJob status conditions) and the agent endpoint's ``/progress``.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from elastic_harness.errors import HarnessError
from elastic_harness.lifecycle import kubectl, registry
from elastic_harness.lifecycle.api import LogQuery, Submission
from elastic_harness.lifecycle.kube import KubeScheduler
from elastic_harness.lifecycle.kubectl import KubeJob
from elastic_harness.spec import parse_job

pytestmark = pytest.mark.timeout(60)

JOB = KubeJob("demo", "ml", "pytorchjob", "prod")
PLAIN = KubeJob("demo", "ml", "plain", "prod")


def pod(index: int, phase: str = "Running", restarts: int = 0, last_exit: int | None = None) -> dict:
    status = {"name": "pytorch", "restartCount": restarts, "state": {"running": {}}}
    if last_exit is not None:
        status["lastState"] = {"terminated": {"exitCode": last_exit, "reason": "Error"}}
    return {"metadata": {"name": f"demo-worker-{index}"}, "spec": {"nodeName": f"node-{index}"},
            "status": {"phase": phase, "containerStatuses": [status]}}


def pytorchjob(*conditions: tuple[str, str]) -> dict:
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "demo"},
            "status": {"conditions": [{"type": t, "status": "True", "message": m} for t, m in conditions]}}


PROGRESS = {"job": "demo", "node": "0", "healthy": True, "health": "ok", "step": 40, "steps_done": 40,
            "loss": 1.25, "world_size": 4, "restarts": 1, "faults": 0, "checkpoints": 4,
            "last_checkpoint_step": 40, "finished": False, "goodput": 0.9, "productive_s": 90.0,
            "wall_s": 100.0, "badput": {}, "updated": 1.0}


def test_commands_name_context_and_namespace():
    assert kubectl.get_workload(JOB) == ["kubectl", "--context", "prod", "--namespace", "ml", "get", "pytorchjob",
                                         "demo", "--ignore-not-found", "-o", "json"]
    assert kubectl.get_workload(PLAIN)[6:8] == ["statefulset", "demo-worker"]
    assert kubectl.get_pods(JOB)[5:] == ["get", "pods", "-l", "app.kubernetes.io/instance=demo,"
                                         "app.kubernetes.io/component=worker", "-o", "json"]
    assert kubectl.progress(JOB, "demo-worker-0", 8080)[-1] == "/api/v1/namespaces/ml/pods/demo-worker-0:8080/proxy/progress"
    assert kubectl.logs(JOB, True, None, 60)[5:] == ["logs", "-l", JOB.selector, "--prefix", "--max-log-requests",
                                                     "64", "-c", "pytorch", "--follow", "--since=60s"]
    assert kubectl.logs(JOB, False, "2", None)[5:] == ["logs", "demo-worker-2", "-c", "pytorch"]
    assert [c[5:8] for c in kubectl.stop(JOB, now=False)] == [["delete", "pytorchjob", "demo"]]
    assert [c[5:8] for c in kubectl.stop(PLAIN, now=False)] == [["scale", "statefulset", "demo-worker"]], \
        "plain: a scale-down, the pods drain in their grace period; etcd and the volume stay"
    now = kubectl.stop(PLAIN, now=True)
    assert now[1][5:] == ["delete", "pods", "-l", PLAIN.selector, "--grace-period=0", "--force", "--ignore-not-found"]


def test_kubectl_json_is_read():
    pods = kubectl.pods({"items": [pod(1, restarts=2, last_exit=143), pod(0), pod(2, phase="Pending")]})
    assert pods == kubectl.Pods(["demo-worker-0", "demo-worker-1"], 2, [143], ["node-0", "node-1", "node-2"])
    live = lambda data, p=pods: kubectl.workload_liveness("pytorchjob", data, p)  # noqa: E731
    assert live(None).phase == "gone"
    assert live(pytorchjob()).phase == "queued"
    assert live(pytorchjob(("Created", ""), ("Running", "PyTorchJob demo is running."))).phase == "running"
    assert live(pytorchjob(("Created", ""), ("Running", "")), kubectl.Pods([], 0, [], [])).phase == "queued"
    done = live(pytorchjob(("Created", ""), ("Succeeded", "PyTorchJob demo successfully completed.")))
    assert (done.phase, done.exit_code) == ("gone", 0)
    failed = kubectl.workload_liveness("pytorchjob", pytorchjob(("Failed", "x")), kubectl.Pods([], 0, [0, 2], []))
    assert (failed.phase, failed.exit_code) == ("gone", 2)
    sts = {"spec": {"replicas": 3}, "status": {"replicas": 3, "readyReplicas": 2}}
    assert kubectl.workload_liveness("statefulset", sts, pods).detail == "StatefulSet: 2/3 pods ready"
    assert kubectl.workload_liveness("statefulset", {"spec": {"replicas": 0}}, pods).phase == "gone"
    looping = kubectl.Pods([], 5, [2, 2], ["node-0"])
    assert kubectl.workload_liveness("statefulset", sts, looping).exit_code == 2, "a StatefulSet restarts a mistake forever"


class Recorded:
    """A command runner answering from ``answers`` (first matching argv fragment wins)."""

    def __init__(self, answers: dict[str, object]) -> None:
        self.answers, self.calls = answers, []

    def __call__(self, cmd: list[str], timeout_s: float = 60, stdin: str | None = None):
        self.calls.append((cmd, stdin))
        text = " ".join(cmd)
        for fragment, answer in self.answers.items():
            if fragment in text:
                out = answer if isinstance(answer, str) else json.dumps(answer)
                return subprocess.CompletedProcess(cmd, 0, out, "")
        return subprocess.CompletedProcess(cmd, 0, "", "")


SPEC = parse_job("name: demo\ntask: {target: 'a.b:C'}\nnodes: {min: 2, max: 4}\nnproc_per_node: 2\n"
                 "rendezvous: {backend: etcd}\ntrain: {global_batch_size: 16}\n")


def submission(job_id: str) -> Submission:
    return Submission(SPEC, Path("/jobs/demo.yaml"), job_id, None,
                      options={"flavor": "pytorchjob", "image": "repo/eh:1", "namespace": "ml"})


def test_submit_applies_with_a_fresh_rendezvous_id_and_replaces_a_finished_job(tmp_path):
    run = Recorded({"current-context": "prod\n", "get pytorchjob": pytorchjob(("Failed", "old run failed")),
                    "get pods": {"items": []}})
    record = KubeScheduler(tmp_path, run).submit(submission("demo-0123456789ab"))
    commands = [" ".join(c[1:3] if "config" in c else c[5:8]) for c, _ in run.calls]
    assert commands == ["config current-context", "get pytorchjob demo", "get pods -l",
                        "delete pytorchjob demo", "get secret demo-key", "create secret generic", "apply -f -"]
    key_stdin = run.calls[-2][1]
    assert len(bytes.fromhex(key_stdin)) == 32 and key_stdin not in " ".join(run.calls[-2][0])
    manifests = list(yaml.safe_load_all(run.calls[-1][1]))
    job = next(m for m in manifests if m and m["kind"] == "PyTorchJob")
    assert job["spec"]["elasticPolicy"]["rdzvId"] == "demo-0123456789ab", "not the job name: a failed id stays closed"
    assert record.details["k8s"] == {"name": "demo", "namespace": "ml", "flavor": "pytorchjob", "context": "prod",
                          "endpoint_port": SPEC.deploy.endpoint_port}


def test_submit_refuses_while_the_job_runs_and_without_a_context(tmp_path):
    running = Recorded({"current-context": "prod\n", "get pytorchjob": pytorchjob(("Running", "")),
                        "get pods": {"items": [pod(0)]}})
    with pytest.raises(HarnessError, match="job 'demo' is still running in namespace ml"):
        KubeScheduler(tmp_path, running).submit(submission("demo-1"))
    assert not any("apply" in c for c, _ in running.calls)

    def no_context(cmd, timeout_s=60, stdin=None):
        return subprocess.CompletedProcess(cmd, 1, "", "error: current-context is not set\n")

    with pytest.raises(HarnessError, match="kubectl has no current context") as e:
        KubeScheduler(tmp_path, no_context).context()
    assert "use-context" in e.value.hint


def test_status_reads_the_job_its_pods_and_the_agent_progress(tmp_path):
    record = registry.JobRecord(id="demo-1", name="demo", scheduler="k8s", submitted=1.0, total_steps=100,
                                details={"k8s": {"name": "demo", "namespace": "ml", "flavor": "pytorchjob",
                                                 "context": "prod", "endpoint_port": 8080}})
    run = Recorded({"proxy/progress": PROGRESS, "get pytorchjob": pytorchjob(("Created", ""), ("Running", "")),
                    "get pods": {"items": [pod(0), pod(1, restarts=1, last_exit=143)]}})
    st = KubeScheduler(tmp_path, run).status(record)
    assert (st.state, st.step, st.total_steps, st.loss, st.world_size, st.nodes) == ("running", 40, 100, 1.25, 4, 2)
    assert (st.restarts, st.last_checkpoint_step, st.wall_s) == (1, 40, 100.0)
    registry.request_stop(record, tmp_path, now=False)
    gone = Recorded({"get pods": {"items": []}})
    stopped = KubeScheduler(tmp_path, gone).status(record)
    assert (stopped.state, stopped.reason) == ("stopped", "stopped on request")
    with pytest.raises(HarnessError, match="--rank needs the run directory"):
        KubeScheduler(tmp_path, gone).logs(record, LogQuery(rank=1), None)


def test_submit_keeps_the_jobs_key_secret(tmp_path):
    """A resubmission reuses the key: the checkpoints it signed must stay loadable."""
    run = Recorded({"current-context": "prod\n", "get secret": "secret/demo-key\n", "get pods": {"items": []}})
    KubeScheduler(tmp_path, run).submit(submission("demo-2"))
    assert not any("create" in c for c, _ in run.calls)
    assert any("apply" in c for c, _ in run.calls)


def test_submit_takes_the_trainjob_flavor_that_k8s_render_takes(tmp_path):
    """`submit --scheduler k8s --flavor trainjob` was refused by argparse, while `k8s render`
    accepts it: now the TrainJob is applied, followed through its conditions, its pods'
    `node` container and their completion-index label, and deleted to stop."""
    from elastic_harness.cli import build_parser

    args = build_parser().parse_args(["submit", "--scheduler", "k8s", "--flavor", "trainjob", "job.yaml"])
    assert KubeScheduler.options(args)["flavor"] == "trainjob"
    sub = Submission(SPEC, Path("/jobs/demo.yaml"), "demo-2", None,
                     options={"flavor": "trainjob", "image": "repo/eh:1", "namespace": "ml"})
    done = {"kind": "TrainJob", "status": {"conditions": [
        {"type": "Complete", "status": "True", "message": "jobs succeeded", "reason": "JobsCompleted"}]}}
    run = Recorded({"current-context": "prod\n", "get trainjob": done, "get pods": {"items": []}})
    record = KubeScheduler(tmp_path, run).submit(sub)
    commands = [" ".join(c[5:8]) for c, _ in run.calls if "config" not in c]
    assert commands[:3] == ["get trainjob demo", "get pods -l", "delete trainjob demo"], "a finished one is replaced"
    manifests = list(yaml.safe_load_all(run.calls[-1][1]))
    assert {m["kind"] for m in manifests if m} >= {"TrainJob", "TrainingRuntime"}
    job = KubeJob("demo", "ml", "trainjob", "prod")
    assert record.details["k8s"]["flavor"] == "trainjob"
    assert kubectl.logs(job, False, "1", None)[5:] == [
        "logs", "-l", f"{job.selector},batch.kubernetes.io/job-completion-index=1", "-c", "node"]
    assert [c[5:8] for c in kubectl.stop(job, now=False)] == [["delete", "trainjob", "demo"]]
    pods = kubectl.pods({"items": []})
    assert kubectl.workload_liveness("trainjob", done, pods) == kubectl.Liveness("gone", 0, "TrainJob Complete: jobs succeeded")
    failed = {"status": {"conditions": [{"type": "Failed", "status": "True", "message": "backoff"}]}}
    assert kubectl.workload_liveness("trainjob", failed, kubectl.Pods([], 0, [2], [])).exit_code == 2
    assert kubectl.workload_liveness("trainjob", {}, kubectl.Pods(["p"], 0, [], [])).phase == "running"
