"""The Kubernetes scheduler: render (``elastic_harness.k8s``), ``kubectl apply``; status,
logs and stop through kubectl (commands and parsing in ``kubectl``).

A submission gets a fresh rendezvous id (the job id) unless the job pins
``rendezvous.id``: a failed job's id can stay closed for hours (etcd keeps a finished
rendezvous about two hours), and it must not block the next submission. Submitting a job
whose workload still runs is refused; a finished PyTorchJob or TrainJob is deleted first
(neither operator reruns a finished one); the volume with the checkpoints stays, so the new submission
resumes.

Progress (step, loss, world size, checkpoints) comes from the agent endpoint's
``/progress`` on the first running pod, through the API server's pod proxy: no port-forward,
nothing to install. Logs: ``kubectl logs`` of the worker pods, prefixed by pod; per rank
logs live in the run directory on the job's volume, so ``--rank`` is refused here.

Every kubectl call goes through ``run`` (``shell.run`` unless a caller passes another):
the tests pass recorded answers.

A record's details: ``k8s``, the objects (name, namespace, flavor, kubectl context) and the
agent endpoint's port. Flags: ``--flavor`` (pytorchjob, plain or trainjob, as ``k8s render``
takes them), ``--image``, ``--namespace``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from elastic_harness.errors import HarnessError
from elastic_harness.k8s.common import FLAVORS
from elastic_harness.lifecycle import kubectl, logsource, registry, shell
from elastic_harness.lifecycle.api import LogQuery, Submission
from elastic_harness.lifecycle.kubectl import KubeJob
from elastic_harness.lifecycle.registry import JobRecord
from elastic_harness.lifecycle.state import JobStatus, decide

Runner = Callable[..., subprocess.CompletedProcess]


class KubeScheduler:
    name = "k8s"
    description = "manifests applied with kubectl"
    keeps_run_dir = False  # on the job's volume, in the cluster

    def __init__(self, root: Path, run: Runner = shell.run) -> None:
        self.root, self.run = root, run

    @staticmethod
    def add_options(parser: argparse.ArgumentParser) -> None:
        k = parser.add_argument_group("k8s")
        k.add_argument("--flavor", choices=FLAVORS, default="pytorchjob",
                       help="k8s: manifest flavor (as `k8s render` takes it; k8s/DEPLOY.md says which to choose)")
        k.add_argument("--image", help="k8s: container image (default: the package's, see k8s render)")
        k.add_argument("--namespace", help="k8s: namespace (default: default)")

    @staticmethod
    def options(args: argparse.Namespace) -> dict:
        from elastic_harness.k8s import DEFAULT_IMAGE

        return {"flavor": args.flavor, "image": args.image or DEFAULT_IMAGE, "namespace": args.namespace or ""}

    def where(self, record: JobRecord) -> str:
        job = _job(record)
        return f"Kubernetes {job.namespace}/{job.name}"

    def summary(self, record: JobRecord) -> dict:
        return {"k8s": record.details.get("k8s") or None}

    def check(self) -> None:
        shell.need("kubectl", "it is needed for --scheduler k8s",
                   "install kubectl, or use `elastic-harness k8s render` and apply the manifests elsewhere")
        self.context()

    def context(self) -> str:
        result = self.run(kubectl.current_context())
        if result.returncode != 0 or not result.stdout.strip():
            raise HarnessError(f"kubectl has no current context ({shell.first_line(result)})",
                               "kubectl config use-context NAME (or set KUBECONFIG); or render the "
                               "manifests with `elastic-harness k8s render` and apply them elsewhere")
        return result.stdout.strip()

    def submit(self, sub: Submission) -> JobRecord:
        from elastic_harness.k8s import render, to_yaml
        from elastic_harness.k8s.common import names_for

        o = sub.options
        spec = dataclasses.replace(sub.spec, rendezvous=dataclasses.replace(sub.spec.rendezvous, id=sub.job_id))
        manifests = render(spec, o.get("flavor", "pytorchjob"), o["image"], o.get("namespace") or None,
                           o.get("script_files"))
        job = KubeJob(names_for(spec).base, o.get("namespace") or "default", o.get("flavor", "pytorchjob"),
                      self.context())
        self._make_room(job)
        self._ensure_key(job, names_for(spec).key_secret)
        result = self.run(kubectl.apply(job), stdin=to_yaml(manifests))
        if result.returncode != 0:
            raise HarnessError(f"kubectl apply failed: {shell.first_line(result)}",
                               "check the cluster and the namespace; `elastic-harness k8s render` shows the manifests")
        return JobRecord(id=sub.job_id, name=spec.name, scheduler="k8s", submitted=time.time(),
                         total_steps=spec.train.steps, job_file=str(sub.job_file),
                         details={"k8s": {**dataclasses.asdict(job), "endpoint_port": spec.deploy.endpoint_port}})

    def _ensure_key(self, job: KubeJob, name: str) -> None:
        """The job's key Secret, created once (docs/security.md): later submissions reuse it,
        so the checkpoints it signed stay loadable."""
        import secrets

        if self.run(kubectl.get_secret(job, name)).stdout.strip():
            return
        result = self.run(kubectl.create_key_secret(job, name), stdin=secrets.token_hex(32))
        if result.returncode != 0:
            raise HarnessError(f"cannot create the job's key Secret {name}: {shell.first_line(result)}",
                               f"create it yourself: kubectl create secret generic {name} "
                               "--from-literal=job.key=$(openssl rand -hex 32)")

    def _make_room(self, job: KubeJob) -> None:
        """Refuse while the workload runs; delete a finished PyTorchJob (module doc)."""
        existing = self._json(kubectl.get_workload(job))
        if existing is None:
            return
        live = kubectl.workload_liveness(job.workload[0], existing, self._pods(job))
        if live.phase in ("queued", "running"):
            raise HarnessError(f"job '{job.name}' is still running in namespace {job.namespace} ({live.detail})",
                               "stop it first (elastic-harness stop), or rename the job (--set name=...)")
        if job.flavor != "plain":  # a finished PyTorchJob or TrainJob is replaced, not re-applied
            self.run(kubectl.delete_workload(job))

    def _json(self, cmd: list[str]) -> dict | None:
        result = self.run(cmd)
        if result.returncode != 0 or not result.stdout.strip():
            return None
        try:
            return json.loads(result.stdout)
        except ValueError:
            return None

    def _pods(self, job: KubeJob) -> kubectl.Pods:
        return kubectl.pods(self._json(kubectl.get_pods(job)) or {})

    def status(self, record: JobRecord) -> JobStatus:
        job = _job(record)
        p = self._pods(job)
        live = kubectl.workload_liveness(job.workload[0], self._json(kubectl.get_workload(job)), p)
        port = record.details["k8s"]["endpoint_port"]
        prog = self._json(kubectl.progress(job, p.running[0], port)) if p.running else None
        prog = prog or {}
        state, reason = decide(finished=bool(prog.get("finished")), exit=None,
                               stop=registry.stop_request(record, self.root), live=live,
                               started=bool(prog.get("world_size")))
        return JobStatus(id=record.id, name=record.name, scheduler="k8s", state=state, reason=reason,
                         where=f"Kubernetes {job.namespace}/{job.name} ({job.context})", step=prog.get("step"),
                         total_steps=record.total_steps, loss=prog.get("loss"),
                         world_size=prog.get("world_size") or None, nodes=len(p.running) or None,
                         restarts=prog.get("restarts", p.restarts if p.running else None),
                         last_checkpoint_step=prog.get("last_checkpoint_step"), wall_s=prog.get("wall_s"),
                         exit_code=live.exit_code, submitted=record.submitted)

    def logs(self, record: JobRecord, query: LogQuery, out: TextIO) -> None:
        if query.rank is not None:
            raise HarnessError("--rank needs the run directory, which is on the job's volume",
                               "use --node N (that node's pod), or read RUN_DIR/logs in a pod")
        since = int(max(1, time.time() - query.since)) if query.since else None
        cmd = kubectl.logs(_job(record), query.follow, query.node, since)
        quiet = None if query.all else logsource.Quiet()  # what is shown (logsource)
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
            assert proc.stdout is not None
            try:
                for line in proc.stdout:
                    for kept in quiet.feed([line.rstrip("\n")], end=False) if quiet else [line.rstrip("\n")]:
                        out.write(kept + "\n")
                for kept in quiet.feed([]) if quiet else []:
                    out.write(kept + "\n")
            finally:
                proc.terminate()

    def stop(self, record: JobRecord, now: bool) -> None:
        for cmd in kubectl.stop(_job(record), now):
            result = self.run(cmd)
            if result.returncode != 0:
                raise HarnessError(f"`{' '.join(cmd[5:8])}` failed: {shell.first_line(result)}",
                                   "check the cluster with kubectl get pods")


def _job(record: JobRecord) -> KubeJob:
    k = record.details["k8s"]
    return KubeJob(k["name"], k["namespace"], k["flavor"], k["context"])

