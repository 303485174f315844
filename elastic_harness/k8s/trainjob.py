"""The ``trainjob`` flavor: Kubeflow Trainer v2 (``trainer.kubeflow.org/v1alpha1``).

Trainer v2 runs a ``TrainJob`` as a JobSet built from the ``TrainingRuntime`` it references;
its torch plugin injects ``PET_NNODES`` (one number: ``numNodes``), ``PET_NPROC_PER_NODE``,
``PET_NODE_RANK``, ``PET_MASTER_ADDR`` and ``PET_MASTER_PORT`` into the container named
``node`` of the replicated job ``node``. That is a static torchrun world: since Trainer
2.2.0 there is no ``ElasticPolicy`` (and no ``numProcPerNode`` in the runtime's torch
policy), so nothing in Trainer lets nodes join or leave a running job.

Elasticity comes from the harness instead: the ``node`` container runs our agent with the
rendezvous on the etcd rendered alongside (``k8s.etcd``, the v3 API) and the node range as
flags (``--nnodes MIN:MAX``), which take precedence over Trainer's ``PET_*`` values. The
TrainJob asks for ``nodes.max`` pods, and one per hot spare (``numNodes``); the group forms once ``nodes.min``
agents are in, and a pod that is scheduled later joins by a membership change.

The runtime's Job (``replicatedJobs[node]``) says what a pod's exit means, as the
PyTorchJob flavor's ``ExitCode`` policy does (``exitcodes``):

- 2, a mistake: ``FailJob`` (the JobSet fails; fix the job);
- 143 (preempted) and 200 (the infrastructure's failure), or a pod evicted or preempted by
  Kubernetes (``DisruptionTarget``): ``Ignore``: the Job replaces the pod without counting
  it, and the new agent rejoins the running group;
- anything else counts against ``backoffLimit`` (``max_restarts``: the agent already spent
  its own restarts before it exits 1).

``successPolicy``: the Job succeeds when one pod has (every agent exits 0 when the job
finishes; a pod still pending then is not waited for). Needs Kubernetes 1.31 or newer.

The runtime is namespaced (a ``TrainingRuntime`` named after the job): it carries this
job's command, image and Secrets, so it is the job's own, not a cluster-wide template.
"""

from __future__ import annotations

from elastic_harness import exitcodes
from elastic_harness.k8s.common import TRAINER_CONTAINER, Target, metadata, obj
from elastic_harness.k8s.etcd import etcd_objects
from elastic_harness.k8s.flavors import etcd_flags, pods
from elastic_harness.k8s.pod import agent_args, pod_template

API = "trainer.kubeflow.org/v1alpha1"
GROUP = "trainer.kubeflow.org"
REPLICATED_JOB = "node"  # Trainer's torch plugin looks for this job and container name
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"  # marks the trainer's job


def render_trainjob(target: Target) -> list[dict]:
    """The etcd, the job's TrainingRuntime, then the TrainJob referencing it."""
    spec = target.spec
    pod = pod_template(target, agent_args(target, etcd_flags(target)), [], etcd_client=True,
                       name=TRAINER_CONTAINER, restart="Never")
    job_spec = {
        "completionMode": "Indexed",  # Trainer's PET_NODE_RANK is the completion index
        "backoffLimit": spec.max_restarts,
        "podFailurePolicy": {"rules": failure_rules()},
        "successPolicy": {"rules": [{"succeededCount": 1}]},
        "template": pod,
    }
    replicated = {"name": REPLICATED_JOB,
                  "template": {"metadata": {"labels": {ANCESTOR_LABEL: "trainer"}}, "spec": job_spec}}
    runtime_meta = metadata(target, target.names.base, "worker")
    runtime_meta["labels"]["trainer.kubeflow.org/framework"] = "torch"
    runtime = obj(API, "TrainingRuntime", runtime_meta, spec={
        "mlPolicy": {"numNodes": pods(spec), "torch": {}},
        "template": {"spec": {"replicatedJobs": [replicated]}},
    })
    train_job = obj(API, "TrainJob", metadata(target, target.names.base), spec={
        "runtimeRef": {"apiGroup": GROUP, "kind": "TrainingRuntime", "name": target.names.base},
        "trainer": {"numNodes": pods(spec), "numProcPerNode": spec.nproc_per_node},
    })
    return [*etcd_objects(target), runtime, train_job]


def failure_rules() -> list[dict]:
    """Pure: the Job's podFailurePolicy rules (module doc), first match wins."""
    def codes(*values: int) -> dict:
        return {"containerName": TRAINER_CONTAINER, "operator": "In", "values": list(values)}

    return [
        {"action": "FailJob", "onExitCodes": codes(exitcodes.PERMANENT)},
        {"action": "Ignore", "onExitCodes": codes(exitcodes.PREEMPTED, exitcodes.INFRA)},
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
    ]
