"""Run the rendered pods' exact container command and environment as local processes.

Two "pods" of the plain flavor (a worker StatefulSet), or of the trainjob flavor (the
TrainingRuntime's ``node`` job, with the variables Kubeflow Trainer injects), start from
the rendered command, args and env, with the job file from the rendered ConfigMap, against
a real local etcd (3.4, the v2 API off: the agents speak v3). The only
substitutions are what a cluster provides: the etcd Service name (no DNS here), the mounted
paths (the job's key Secret included), etcd's TLS (a plain local etcd), and a free endpoint
port (both pods share one network namespace here).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from elastic_harness.k8s.render import render
from elastic_harness.spec import parse_job
from tests.conftest import REPO, read_jsonl
from tests.k8s.test_k8s import trainer_env
from tests.servers import etcd_server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

JOB = """
name: podtest
task: {target: "elastic_harness.tasks.mlp:MLPRegression"}
nodes: {min: 2, max: 2}
nproc_per_node: 1
train: {steps: 40, global_batch_size: 30, micro_batch_size: 8}
checkpoint: {every_steps: 10}
"""


def worker_container(manifests: list[dict]) -> tuple[dict, str]:
    (cm,) = [m for m in manifests if m["kind"] == "ConfigMap"]
    runtimes = [m for m in manifests if m["kind"] == "TrainingRuntime"]
    if runtimes:
        (replicated,) = runtimes[0]["spec"]["template"]["spec"]["replicatedJobs"]
        (container,) = [c for c in replicated["template"]["spec"]["template"]["spec"]["containers"]
                        if c["name"] == "node"]
        return container, cm["data"]["job.yaml"]
    (sts,) = [m for m in manifests if m["kind"] == "StatefulSet" and m["metadata"]["name"].endswith("-worker")]
    (container,) = [c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "pytorch"]
    return container, cm["data"]["job.yaml"]


def localize(container: dict, job_file: str, run_dir: str, etcd: str) -> list[str]:
    args = list(container["args"])
    # the local etcd speaks plain http (the rendered https + client certificate settings
    # need the cluster's Secrets): an empty --rdzv-conf keeps the job's own settings
    replace = {"--rdzv-endpoint": etcd, "--run-dir": run_dir, "--endpoint-port": "0",
               "--endpoint-host": "127.0.0.1", "--rdzv-conf": ""}
    for flag, value in replace.items():
        args[args.index(flag) + 1] = value
    assert args[0] == "/etc/elastic-harness/job.yaml"
    args[0] = job_file
    assert container["command"] == ["elastic-harness", "agent"]
    return [sys.executable, "-m", "elastic_harness", "agent", *args]


@pytest.mark.parametrize("flavor", ["plain", "trainjob"])
def test_rendered_pods_form_a_group_and_train(tmp_path, flavor):
    manifests = render(parse_job(JOB), flavor)
    container, job_yaml = worker_container(manifests)
    job_file = tmp_path / "job.yaml"
    job_file.write_text(job_yaml)
    env = {**os.environ, **{e["name"]: e["value"] for e in container["env"] if "value" in e}}
    assert env["ELASTIC_HARNESS_KEY_FILE"] == "/etc/elastic-harness/key/job.key"  # the mounted Secret
    (tmp_path / "job.key").write_text("ab" * 32)
    (tmp_path / "job.key").chmod(0o440)  # as the rendered manifests mount the Secret
    env["ELASTIC_HARNESS_KEY_FILE"] = str(tmp_path / "job.key")
    run_dir = tmp_path / "runs" / "podtest"
    with etcd_server(tmp_path / "etcd-data") as etcd:
        cmd = localize(container, str(job_file), str(run_dir), etcd)
        pods = [subprocess.Popen(cmd, cwd=REPO, env={**env, **injected(manifests, rank)}, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, start_new_session=True) for rank in range(2)]
        try:
            codes = [p.wait(timeout=240) for p in pods]
        finally:
            for p in pods:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
    assert codes == [0, 0]
    events = read_jsonl(run_dir / "events.jsonl")
    assert [e["world_size"] for e in events if e["event"] == "rendezvous"] == [2]
    (finish,) = [e for e in events if e["event"] == "finish"]
    assert finish["step"] == 40 and finish["world_size"] == 2


def injected(manifests: list[dict], rank: int) -> dict[str, str]:
    """What the scheduler adds to a pod's environment: Trainer's PET_* for a TrainJob."""
    jobs = [m for m in manifests if m["kind"] == "TrainJob"]
    return trainer_env(jobs[0], rank) if jobs else {}
