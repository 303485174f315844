"""The flavors: the objects each adds around the shared node pod.

``pytorchjob``: the Kubeflow training operator (v1) creates the node pods from a PyTorchJob
and passes the rendezvous to the agent as PET_* variables taken from ``elasticPolicy``.
``plain``: no operator; node pods come from a StatefulSet and rendezvous through an etcd
rendered alongside, passed to the agent as flags.
Every flavor starts ``nodes.max + nodes.spares`` node pods (``pods``): the spares' agents wait
in the rendezvous until a node is lost.
``trainjob``: Kubeflow Trainer v2 (``k8s.trainjob``).
"""

from __future__ import annotations

from elastic_harness.k8s.common import OPERATOR_PORT_NAME, Target, job_id, labels, metadata, obj
from elastic_harness.k8s.etcd import check_backend, client_endpoint, client_tls_conf, etcd_objects
from elastic_harness.k8s.pod import agent_args, pod_template
from elastic_harness.spec.backends import BY_NAME, RENDERED_ETCD


def pods(spec) -> int:
    """Node pods to start: ``nodes.max`` and the hot spares (``nodes.spares``). A spare is an
    agent beyond the node range its ``--nnodes MIN:MAX`` names: it waits in the rendezvous
    (torch's redundancy list) and takes a lost node's place at the same world size."""
    return spec.nodes.max + spec.nodes.spares


def rendezvous_id(target: Target) -> str:
    """One id shared by every node pod: the spec's, else the Kubernetes job name.

    Agents must agree on it, so it cannot be drawn per pod the way local runs draw one.
    ``submit --scheduler k8s`` sets ``rendezvous.id`` to a fresh id per submission (a failed
    job's id can stay closed for hours); manifests rendered by hand keep the job name.
    """
    return job_id(target)


def etcd_flags(target: Target) -> dict[str, object]:
    """The agent's flags for the rendered etcd: the rendezvous and the node range (flags,
    so that no variable a scheduler injects, such as Trainer's PET_NNODES=N, overrides them)."""
    spec = target.spec
    check_backend(target)
    return {
        "rdzv-backend": RENDERED_ETCD.name,
        "rdzv-endpoint": client_endpoint(target),
        "rdzv-id": rendezvous_id(target),
        "nnodes": f"{spec.nodes.min}:{spec.nodes.max}",
        "nproc-per-node": spec.nproc_per_node,
        "max-restarts": spec.max_restarts,
        "rdzv-conf": ",".join(f"{k}={v}" for k, v in client_tls_conf(target).items()),  # https + client cert
    }


def render_plain(target: Target) -> list[dict]:
    spec = target.spec
    flags = etcd_flags(target)
    selector = labels(target, "worker")
    service = {
        "clusterIP": "None",
        # pods rendezvous before they are ready, so their names must resolve before that
        "publishNotReadyAddresses": True,
        "selector": selector,
        "ports": [{"name": "endpoint", "port": spec.deploy.endpoint_port}],
    }
    workers = {
        "serviceName": target.names.worker,
        "replicas": pods(spec),
        # every node joins at once; the rendezvous, not the pod order, forms the group
        "podManagementPolicy": "Parallel",
        "selector": {"matchLabels": selector},
        "template": pod_template(target, agent_args(target, flags), [], etcd_client=True),
    }
    meta = metadata(target, target.names.worker, "worker")
    return [
        *etcd_objects(target),
        obj("v1", "Service", meta, spec=service),
        obj("apps/v1", "StatefulSet", meta, spec=workers),
    ]


def render_pytorchjob(target: Target) -> list[dict]:
    spec = target.spec
    check_backend(target)
    # The operator's rdzvBackend is the spec's word (a plain string in the CRD); it passes it on
    # as PET_RDZV_BACKEND, which the agent reads as the spec's word: etcd is ours, on the v3 API.
    backend = spec.rendezvous.backend
    policy, ports, extra = elastic_policy(target, backend)
    # With spares the operator's range (MIN:MAX+spares, from maxReplicas) would train them as
    # nodes: the agents' flag, which wins over PET_NNODES, keeps the job's range.
    flags = {"nnodes": f"{spec.nodes.min}:{spec.nodes.max}"} if spec.nodes.spares else {}
    worker = {
        "replicas": pods(spec),
        # ExitCode retries 128..255 and fails on 1..127: a preempted agent exits 143 (128+15)
        # and an infrastructure failure 200 (exitcodes.INFRA), both retried; a mistake exits 2
        "restartPolicy": "ExitCode",
        "template": pod_template(target, agent_args(target, flags), ports, etcd_client=not BY_NAME[backend].hosts_store),
    }
    # spec.nprocPerNode, not elasticPolicy.nProcPerNode (deprecated since operator v1.7; the
    # webhook forbids both). The operator's elastic env generator turns only the deprecated
    # one into PET_NPROC_PER_NODE; without it the agent reads nproc_per_node from the job in
    # the ConfigMap, the same number.
    body = {"nprocPerNode": str(spec.nproc_per_node), "elasticPolicy": policy,
            "pytorchReplicaSpecs": {"Worker": worker}}
    job = obj("kubeflow.org/v1", "PyTorchJob", metadata(target, target.names.base), spec=body)
    return [*extra, job]


def elastic_policy(target: Target, backend: str) -> tuple[dict, list[dict], list[dict]]:
    """The PyTorchJob's ``elasticPolicy``, the node container's ports, and the objects the
    rendezvous needs besides (the rendered etcd)."""
    spec = target.spec
    policy: dict = {
        "minReplicas": spec.nodes.min,
        "maxReplicas": pods(spec),  # the operator's PET_NNODES; spares: the agents' --nnodes keeps MIN:MAX
        "rdzvBackend": backend,
        "rdzvId": rendezvous_id(target),
        "maxRestarts": spec.max_restarts,
    }
    if BY_NAME[backend].hosts_store:
        # the store lives in the first worker's agent: PET_RDZV_ENDPOINT=<job>-worker-0:port
        policy["rdzvPort"] = spec.deploy.rdzv_port
        return policy, [{"name": OPERATOR_PORT_NAME, "containerPort": spec.deploy.rdzv_port}], []
    host, port = client_endpoint(target).rsplit(":", 1)
    policy.update(rdzvHost=host, rdzvPort=int(port))
    # becomes PET_RDZV_CONF: https and the agents' client certificate
    policy["rdzvConf"] = [{"key": k, "value": v} for k, v in client_tls_conf(target).items()]
    return policy, [], etcd_objects(target)
