"""Pure: the kubectl commands a Kubernetes job needs, and what their JSON output means.

Commands are lists for ``subprocess``; every one names the context and namespace recorded
at submission, so switching kubectl's current context later does not retarget a job.
Object names follow ``elastic_harness.k8s`` (``<name>-worker``, pods ``<name>-worker-N``,
labels ``app.kubernetes.io/instance=<name>``, ``component=worker``, container ``pytorch``).

Stopping: the PyTorchJob is deleted (its pods get their termination grace period, which
outlasts the drain: ``k8s.pod``); the plain flavor's worker StatefulSet is scaled to zero
(the same graceful pod shutdown, and etcd and the volume stay). ``now``: pods are also
deleted with ``--grace-period=0 --force``.

The JSON shapes read are the Kubernetes API's: ``status.conditions`` of a Kubeflow
PyTorchJob (training-operator v1: types Created, Running, Restarting, Succeeded, Failed),
``spec.replicas``/``status.readyReplicas`` of a StatefulSet, and ``status.phase``,
``status.containerStatuses[].restartCount`` / ``state.terminated.exitCode`` of pods; and
the agent endpoint's ``/progress`` (``agent.endpoint``) through the API server's pod proxy.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic_harness import exitcodes
from elastic_harness.k8s.common import CONTAINER, TRAINER_CONTAINER
from elastic_harness.lifecycle.state import Liveness


@dataclass(frozen=True)
class KubeJob:
    name: str  # the job's object base name (k8s.common.names_for)
    namespace: str
    flavor: str  # "pytorchjob", "plain" or "trainjob"
    context: str

    @property
    def selector(self) -> str:
        return f"app.kubernetes.io/instance={self.name},app.kubernetes.io/component=worker"

    @property
    def workload(self) -> tuple[str, str]:
        """(kind, name) of the object that owns the node pods (a TrainJob's, through its JobSet)."""
        if self.flavor in ("pytorchjob", "trainjob"):
            return self.flavor, self.name
        return "statefulset", f"{self.name}-worker"

    @property
    def container(self) -> str:
        return TRAINER_CONTAINER if self.flavor == "trainjob" else CONTAINER

    def pod(self, node: int | str) -> str:
        return f"{self.name}-worker-{node}"


def kubectl(job: KubeJob, *args: str) -> list[str]:
    return ["kubectl", "--context", job.context, "--namespace", job.namespace, *args]


def current_context() -> list[str]:
    return ["kubectl", "config", "current-context"]


def apply(job: KubeJob) -> list[str]:
    return kubectl(job, "apply", "-f", "-")  # the manifests on stdin


def get_secret(job: KubeJob, name: str) -> list[str]:
    return kubectl(job, "get", "secret", name, "--ignore-not-found", "-o", "name")


def create_key_secret(job: KubeJob, name: str) -> list[str]:
    """The job's key Secret (``jobkey``, docs/security.md), the key on stdin, not in argv."""
    return kubectl(job, "create", "secret", "generic", name, "--from-file=job.key=/dev/stdin")


def get_workload(job: KubeJob) -> list[str]:
    kind, name = job.workload
    return kubectl(job, "get", kind, name, "--ignore-not-found", "-o", "json")


def delete_workload(job: KubeJob) -> list[str]:
    kind, name = job.workload
    return kubectl(job, "delete", kind, name, "--ignore-not-found", "--wait=false")


def get_pods(job: KubeJob) -> list[str]:
    return kubectl(job, "get", "pods", "-l", job.selector, "-o", "json")


def progress(job: KubeJob, pod: str, port: int) -> list[str]:
    return kubectl(job, "get", "--raw", f"/api/v1/namespaces/{job.namespace}/pods/{pod}:{port}/proxy/progress")


def logs(job: KubeJob, follow: bool, node: str | None, since_s: int | None) -> list[str]:
    if node is not None and job.flavor == "trainjob":  # JobSet names its pods; the index is a label
        where = ["-l", f"{job.selector},batch.kubernetes.io/job-completion-index={node}"]
    elif node is not None:
        where = [job.pod(node)]
    else:
        where = ["-l", job.selector, "--prefix", "--max-log-requests", "64"]
    extra = (["--follow"] if follow else []) + ([f"--since={since_s}s"] if since_s else [])
    return kubectl(job, "logs", *where, "-c", job.container, *extra)


def stop(job: KubeJob, now: bool) -> list[list[str]]:
    kind, name = job.workload
    first = (kubectl(job, "delete", kind, name, "--ignore-not-found", "--wait=false") if kind != "statefulset"
             else kubectl(job, "scale", kind, name, "--replicas=0"))
    if not now:
        return [first]
    return [first, kubectl(job, "delete", "pods", "-l", job.selector, "--grace-period=0", "--force",
                           "--ignore-not-found")]


# ----- parsing --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pods:
    running: list[str]  # names of running pods, by name
    restarts: int  # container restarts summed over pods
    exit_codes: list[int]  # of terminated containers (this run or the last)
    nodes: list[str]  # Kubernetes nodes the pods are on


def pods(data: dict) -> Pods:
    running, codes, nodes, restarts = [], [], [], 0
    for item in sorted(data.get("items") or [], key=lambda p: p.get("metadata", {}).get("name", "")):
        status = item.get("status") or {}
        if status.get("phase") == "Running":
            running.append(item["metadata"]["name"])
        if (item.get("spec") or {}).get("nodeName"):
            nodes.append(item["spec"]["nodeName"])
        for c in status.get("containerStatuses") or []:
            restarts += int(c.get("restartCount") or 0)
            ended = (c.get("state") or {}).get("terminated") or (c.get("lastState") or {}).get("terminated")
            if ended and ended.get("exitCode") is not None:
                codes.append(int(ended["exitCode"]))
    return Pods(running, restarts, codes, nodes)


def workload_liveness(kind: str, data: dict | None, p: Pods) -> Liveness:
    """The owner object's state (None: it does not exist) -> ``Liveness``."""
    if data is None:
        return Liveness("gone", detail="its workload is gone (deleted or never created)")
    if kind == "pytorchjob":
        return _pytorchjob(data, p)
    if kind == "trainjob":
        return _trainjob(data, p)
    replicas = int((data.get("spec") or {}).get("replicas") or 0)
    ready = int((data.get("status") or {}).get("readyReplicas") or 0)
    if replicas == 0:
        return Liveness("gone", detail="StatefulSet scaled to 0")
    if not p.running and exitcodes.PERMANENT in p.exit_codes:
        # A StatefulSet restarts its pods whatever their exit code: a permanent error loops.
        return Liveness("gone", exit_code=exitcodes.PERMANENT,
                        detail="the agents exit 2 (a mistake to fix) and their pods restart in a loop")
    return Liveness("running" if p.running else "queued", detail=f"StatefulSet: {ready}/{replicas} pods ready")


def _pytorchjob(data: dict, p: Pods) -> Liveness:
    conditions = [c for c in (data.get("status") or {}).get("conditions") or [] if c.get("status") == "True"]
    if not conditions:
        return Liveness("queued", detail="PyTorchJob: no condition yet")
    last = conditions[-1]
    kind, said = last.get("type", ""), f"PyTorchJob {last.get('type', '?')}: {last.get('message', '')}".rstrip(": ")
    if kind == "Succeeded":
        return Liveness("gone", exit_code=0, detail=said)
    if kind == "Failed":
        codes = [c for c in p.exit_codes if c]
        return Liveness("gone", exit_code=codes[-1] if codes else 1, detail=said)
    if kind in ("Running", "Restarting"):
        return Liveness("running" if p.running else "queued", detail=said)
    return Liveness("queued", detail=said)


def _trainjob(data: dict, p: Pods) -> Liveness:
    """Kubeflow Trainer v2's ``TrainJob`` conditions (Suspended, Complete, Failed)."""
    conditions = {c.get("type"): c for c in (data.get("status") or {}).get("conditions") or []
                  if c.get("status") == "True"}
    for kind in ("Complete", "Failed"):
        if kind in conditions:
            said = f"TrainJob {kind}: {conditions[kind].get('message', '')}".rstrip(": ")
            codes = [c for c in p.exit_codes if c]
            return Liveness("gone", exit_code=0 if kind == "Complete" else (codes[-1] if codes else 1), detail=said)
    if "Suspended" in conditions:
        return Liveness("queued", detail="TrainJob Suspended")
    return Liveness("running" if p.running else "queued", detail=f"TrainJob: {len(p.running)} pod(s) running")
