"""A three-member etcd for the etcd rendezvous backend (etcd's v3 API: ``rendezvous.etcd_v3``).

The image is etcd 3.6 (``deploy.etcd_image``), which has no v2 API, so the rendered etcd
cannot serve ``rendezvous.backend: etcd-v2`` (``check_backend`` refuses it). The agents'
client learns every member from the one Service name it is given, and fails over between
them (``rendezvous.etcd_gateway``). Each member keeps its data on its own
volume: a member that restarts with an empty data dir cannot rejoin its cluster. The
volumes are deleted with the StatefulSet, so a re-applied job starts with a fresh etcd
(etcd remembers finished rendezvous ids for about two hours).

TLS and authentication (docs/security.md): clients and peers speak https, and etcd admits only
clients with a certificate signed by the job's CA (``--client-cert-auth``). The server and
peer certificate come from the Secret ``<job>-etcd-tls`` (``tls.crt``, ``tls.key``,
``ca.crt``: cert-manager's layout; SANs ``*.<job>-etcd``, ``<job>-etcd-client``; usages
server and client auth: etcd's v3 JSON gateway dials etcd's own gRPC with it), the
agents' client certificate from ``<job>-etcd-client-tls``; neither is rendered (the user or
cert-manager provides them, docs/security.md). Probes read ``/health`` over plain http on
the separate metrics port, which serves no keys.
"""

from __future__ import annotations

from elastic_harness.k8s.common import (
    ETCD_CLIENT_PORT,
    ETCD_CLIENT_TLS_DIR,
    ETCD_MEMBERS,
    ETCD_METRICS_PORT,
    ETCD_PEER_PORT,
    ETCD_TLS_DIR,
    RenderError,
    Target,
    labels,
    metadata,
    obj,
    pod_labels,
)
from elastic_harness.k8s.pod import container_security, pod_security
from elastic_harness.spec.backends import BY_NAME, RENDERED_ETCD

_DATA = "/var/run/etcd"
_VOLUME_SIZE = "1Gi"  # rendezvous state is a few keys


def client_endpoint(target: Target) -> str:
    return f"{target.names.etcd_client}:{ETCD_CLIENT_PORT}"


def check_backend(target: Target) -> None:
    """The rendered etcd has no v2 API: ``etcd-v2`` cannot rendezvous through it."""
    row = BY_NAME[target.spec.rendezvous.backend]
    if not (row.hosts_store or row is RENDERED_ETCD):
        raise RenderError("rendezvous.backend is etcd-v2, but the rendered etcd (3.6 or newer) has no v2 API",
                          "use rendezvous.backend: etcd (the v3 API): --set rendezvous.backend=etcd")


def client_tls_conf(target: Target) -> dict[str, str]:
    """The rendezvous settings (torch's etcd keys, which ours read too) for https with the
    client certificate."""
    return {"protocol": "https", "ca_cert": f"{ETCD_CLIENT_TLS_DIR}/ca.crt",
            "ssl_cert": f"{ETCD_CLIENT_TLS_DIR}/tls.crt", "ssl_cert_key": f"{ETCD_CLIENT_TLS_DIR}/tls.key"}


def etcd_objects(target: Target) -> list[dict]:
    """Peer Service (headless), client Service, StatefulSet and its disruption budget."""
    names = target.names
    ports = [
        {"name": "client", "port": ETCD_CLIENT_PORT, "targetPort": "client"},
        {"name": "peer", "port": ETCD_PEER_PORT, "targetPort": "peer"},
    ]
    selector = labels(target, "etcd")
    peers = {
        "clusterIP": "None",
        # members must find each other before any is ready: readiness needs a quorum
        "publishNotReadyAddresses": True,
        "selector": selector,
        "ports": ports,
    }
    client = {"selector": selector, "ports": ports[:1]}
    budget = {"maxUnavailable": 1, "selector": {"matchLabels": selector}}
    return [
        obj("v1", "Service", metadata(target, names.etcd, "etcd"), spec=peers),
        obj("v1", "Service", metadata(target, names.etcd_client, "etcd"), spec=client),
        _statefulset(target),
        obj("policy/v1", "PodDisruptionBudget", metadata(target, names.etcd, "etcd"), spec=budget),
    ]


def _args(target: Target) -> list[str]:
    svc = target.names.etcd
    members = ",".join(
        f"{svc}-{i}=https://{svc}-{i}.{svc}:{ETCD_PEER_PORT}" for i in range(ETCD_MEMBERS)
    )
    tls = ETCD_TLS_DIR
    # $(POD_NAME) is expanded by the kubelet from the container's env, not by a shell
    return [
        "--name=$(POD_NAME)",
        f"--data-dir={_DATA}/data",
        f"--listen-client-urls=https://0.0.0.0:{ETCD_CLIENT_PORT}",
        f"--advertise-client-urls=https://$(POD_NAME).{svc}:{ETCD_CLIENT_PORT}",
        f"--listen-peer-urls=https://0.0.0.0:{ETCD_PEER_PORT}",
        f"--initial-advertise-peer-urls=https://$(POD_NAME).{svc}:{ETCD_PEER_PORT}",
        f"--listen-metrics-urls=http://0.0.0.0:{ETCD_METRICS_PORT}",
        f"--initial-cluster={members}",
        "--initial-cluster-state=new",
        f"--initial-cluster-token={svc}",
        # clients and peers: https, and only with a certificate signed by the job's CA
        f"--cert-file={tls}/tls.crt", f"--key-file={tls}/tls.key", f"--trusted-ca-file={tls}/ca.crt",
        "--client-cert-auth=true",
        f"--peer-cert-file={tls}/tls.crt", f"--peer-key-file={tls}/tls.key",
        f"--peer-trusted-ca-file={tls}/ca.crt", "--peer-client-cert-auth=true",
    ]


def _container(target: Target) -> dict:
    return {
        "name": "etcd",
        "image": target.spec.deploy.etcd_image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["/usr/local/bin/etcd"],
        "args": _args(target),
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "ports": [
            {"name": "client", "containerPort": ETCD_CLIENT_PORT},
            {"name": "peer", "containerPort": ETCD_PEER_PORT},
            {"name": "metrics", "containerPort": ETCD_METRICS_PORT},
        ],
        "resources": {
            "requests": {"cpu": "100m", "memory": "256Mi"},
            "limits": {"memory": "512Mi"},
        },
        "readinessProbe": {"httpGet": {"path": "/health", "port": "metrics"}, "periodSeconds": 5},
        "livenessProbe": {
            "tcpSocket": {"port": "client"},
            "initialDelaySeconds": 10,
            "periodSeconds": 10,
            "failureThreshold": 6,
        },
        "securityContext": container_security(),
        "volumeMounts": [{"name": "data", "mountPath": _DATA},
                         {"name": "tls", "mountPath": ETCD_TLS_DIR, "readOnly": True}],
    }


def _statefulset(target: Target) -> dict:
    selector = labels(target, "etcd")
    claim = {
        "metadata": {"name": "data"},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": _VOLUME_SIZE}},
        },
    }
    spec = {
        "serviceName": target.names.etcd,
        "replicas": ETCD_MEMBERS,
        # all members start together: the first cannot become ready without the others
        "podManagementPolicy": "Parallel",
        "selector": {"matchLabels": selector},
        "template": {
            "metadata": {"labels": pod_labels(target, "etcd")},
            "spec": {
                "automountServiceAccountToken": False,
                "enableServiceLinks": False,
                "securityContext": pod_security(target),
                "containers": [_container(target)],
                "volumes": [{"name": "tls", "secret": {"secretName": target.names.etcd_tls_secret,
                                                        "defaultMode": 0o440}}],
            },
        },
        "volumeClaimTemplates": [claim],
        "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Delete", "whenScaled": "Retain"},
    }
    meta = metadata(target, target.names.etcd, "etcd")
    return obj("apps/v1", "StatefulSet", meta, spec=spec)
