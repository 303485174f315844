"""The node pod both flavors share: one ``pytorch`` container running the elastic agent.

The container's main process is ``elastic-harness agent JOB_FILE [flags]``: it starts
``nproc_per_node`` workers and answers GET /healthz on ``deploy.endpoint_port``.
"""

from __future__ import annotations

from elastic_harness.k8s.common import (
    CONTAINER,
    DATA_DIR,
    ETCD_CLIENT_TLS_DIR,
    JOB_DIR,
    JOB_FILE,
    KEY_DIR,
    KEY_FILE,
    RenderError,
    Target,
    pod_labels,
)

S3_PREFIX = "s3://"
# Keys read from deploy.s3_secret: required ones fail the pod's start if missing.
_S3_REQUIRED = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
_S3_OPTIONAL = ("AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL")


def uses_s3(target: Target) -> bool:
    return target.spec.checkpoint.dir.startswith(S3_PREFIX)


def run_dir(target: Target) -> str:
    """Where the agent keeps events, summary and (unless s3://) checkpoints."""
    return f"{DATA_DIR}/runs/{target.spec.name}"


def check_storage(target: Target) -> None:
    """Checkpoints must be on storage every node sees, or resharding has nothing to load."""
    ckpt = target.spec.checkpoint.dir
    if not ckpt or ckpt.startswith(S3_PREFIX) or ckpt.startswith(f"{DATA_DIR}/"):
        return
    raise RenderError(
        f"checkpoint.dir '{ckpt}' is not on storage shared by all pods",
        f"leave it empty (checkpoints go under {DATA_DIR}, a ReadWriteMany volume), "
        f"use a path under {DATA_DIR}/, or an s3:// URL: --set checkpoint.dir=",
    )


def check_devices(target: Target) -> None:
    spec = target.spec
    if spec.device == "cuda" and spec.deploy.gpus < spec.nproc_per_node:
        raise RenderError(
            f"device is cuda with nproc_per_node={spec.nproc_per_node} but deploy.gpus="
            f"{spec.deploy.gpus}",
            f"set deploy.gpus to at least {spec.nproc_per_node}, or device: cpu",
        )


def agent_args(target: Target, flags: dict[str, object]) -> list[str]:
    """Arguments after ``elastic-harness agent``: the job file, then ``--flag value`` pairs."""
    args = [JOB_FILE]
    common = {"run-dir": run_dir(target), "endpoint-port": target.spec.deploy.endpoint_port,
              "endpoint-host": "0.0.0.0"}
    for key, value in {**flags, **common}.items():
        args += [f"--{key}", str(value)]
    return args


def _env(target: Target) -> list[dict]:
    env = [{"name": "PYTHONUNBUFFERED", "value": "1"}, {"name": "HOME", "value": "/tmp"},
           # the job's key (jobkey): a path to the mounted Secret, never the key itself
           {"name": "ELASTIC_HARNESS_KEY_FILE", "value": KEY_FILE}]
    if uses_s3(target):
        secret = target.spec.deploy.s3_secret
        for key in _S3_REQUIRED + _S3_OPTIONAL:
            ref = {"name": secret, "key": key}
            if key in _S3_OPTIONAL:
                ref["optional"] = True
            env.append({"name": key, "valueFrom": {"secretKeyRef": ref}})
    return env


def _resources(target: Target) -> dict:
    deploy = target.spec.deploy
    requests = {"cpu": deploy.cpu, "memory": deploy.memory}
    limits = {"memory": deploy.memory}  # no CPU limit: throttling stalls collectives
    if deploy.gpus:
        requests["nvidia.com/gpu"] = deploy.gpus
        limits["nvidia.com/gpu"] = deploy.gpus
    return {"requests": requests, "limits": limits}


def _probes(target: Target) -> dict:
    """Probes on the agent's endpoint; it must answer while waiting in rendezvous too."""
    get = {"path": "/healthz", "port": "endpoint"}
    return {
        # importing torch takes seconds; allow two minutes before liveness applies
        "startupProbe": {"httpGet": get, "periodSeconds": 2, "failureThreshold": 60},
        "livenessProbe": {
            "httpGet": get,
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
        "readinessProbe": {"httpGet": get, "periodSeconds": 5, "failureThreshold": 3},
    }


def container_security() -> dict:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def pod_security(target: Target) -> dict:
    uid = target.spec.deploy.run_as_user
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "fsGroup": uid,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container(target: Target, args: list[str], ports: list[dict], etcd_client: bool = False,
              name: str = CONTAINER) -> dict:
    secrets = [{"name": "key", "mountPath": KEY_DIR, "readOnly": True}]
    if etcd_client:
        secrets.append({"name": "etcd-tls", "mountPath": ETCD_CLIENT_TLS_DIR, "readOnly": True})
    return {
        "name": name,
        "image": target.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["elastic-harness", "agent"],
        "args": args,
        "env": _env(target),
        "ports": [
            {"name": "endpoint", "containerPort": target.spec.deploy.endpoint_port},
            *ports,
        ],
        "resources": _resources(target),
        **_probes(target),
        "securityContext": container_security(),
        "volumeMounts": [
            {"name": "job", "mountPath": JOB_DIR, "readOnly": True},
            {"name": "data", "mountPath": DATA_DIR},
            {"name": "shm", "mountPath": "/dev/shm"},
            {"name": "tmp", "mountPath": "/tmp"},
            *secrets,
        ],
    }


def _volumes(target: Target, etcd_client: bool) -> list[dict]:
    names = target.names
    # with s3:// checkpoints the run files stay in the pod and go with it
    data = (
        {"emptyDir": {}}
        if uses_s3(target)
        else {"persistentVolumeClaim": {"claimName": names.volume_claim}}
    )
    shm = {"medium": "Memory", "sizeLimit": target.spec.deploy.shm_size}
    return [
        {"name": "job", "configMap": _job_config_volume(target)},
        {"name": "data", **data},
        {"name": "shm", "emptyDir": shm},
        {"name": "tmp", "emptyDir": {}},
        # Secrets the user or cert-manager provides (docs/security.md); 0440: the pod's group
        {"name": "key", "secret": {"secretName": names.key_secret, "defaultMode": 0o440}},
        *([{"name": "etcd-tls", "secret": {"secretName": names.etcd_client_tls_secret, "defaultMode": 0o440}}]
          if etcd_client else []),
    ]


def _job_config_volume(target: Target) -> dict:
    """The ConfigMap as files under ``JOB_DIR``; with ``items`` (every key listed, those of
    a package's files under their subdirectory) when any file is not at the top."""
    volume: dict = {"name": target.names.config}
    if target.config_paths:
        volume["items"] = [{"key": key, "path": path} for key, path in target.config_paths]
    return volume


def pod_template(target: Target, args: list[str], ports: list[dict], etcd_client: bool = False,
                 name: str = CONTAINER, restart: str | None = None) -> dict:
    """The node pod template; the grace period outlasts the agent's drain-and-save.
    ``etcd_client``: mount the agents' etcd client certificate (etcd backends); ``name``:
    the agent's container; ``restart``: the pod's restartPolicy (a Job's pods need one)."""
    check_storage(target)
    check_devices(target)
    spec = target.spec
    grace = spec.timeouts.shutdown_grace + spec.deploy.grace_margin
    pod = {
        "automountServiceAccountToken": False,  # the agent never calls the API server
        "enableServiceLinks": False,
        **({"restartPolicy": restart} if restart else {}),
        "terminationGracePeriodSeconds": grace,
        "securityContext": pod_security(target),
        "containers": [container(target, args, ports, etcd_client, name)],
        "volumes": _volumes(target, etcd_client),
    }
    return {"metadata": {"labels": pod_labels(target, "worker")}, "spec": pod}
