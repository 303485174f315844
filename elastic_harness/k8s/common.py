"""Names, labels and constants shared by every rendered object.

One ``Target`` carries what the renderers need (the spec, the object names, the image and
the namespace); every helper here is pure and returns plain dicts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from elastic_harness.errors import HarnessError
from elastic_harness.spec import JobSpec

FLAVORS = ("pytorchjob", "plain", "trainjob")

CONTAINER = "pytorch"  # the training operator finds its container by this name
TRAINER_CONTAINER = "node"  # Kubeflow Trainer v2's torch plugin finds its container by this name
JOB_DIR = "/etc/elastic-harness"
JOB_FILE = f"{JOB_DIR}/job.yaml"
DATA_DIR = "/mnt/elastic-harness"
ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380
ETCD_MEMBERS = 3  # survives the loss of one member; one etcd is a single point of failure
OPERATOR_PORT_NAME = "pytorchjob-port"  # the operator reads the rendezvous port from this name
ETCD_METRICS_PORT = 2381  # etcd's plain-http /health for probes (client port needs a client cert)
# Secrets the user (or cert-manager) provides; mounted read-only, never rendered (docs/security.md)
KEY_DIR = f"{JOB_DIR}/key"  # the job's HMAC key (``jobkey``): Secret <job>-key, key job.key
KEY_FILE = f"{KEY_DIR}/job.key"
ETCD_TLS_DIR = "/etc/etcd/tls"  # etcd's server/peer certificate: Secret <job>-etcd-tls
ETCD_CLIENT_TLS_DIR = f"{JOB_DIR}/etcd-tls"  # the agents' client certificate: <job>-etcd-client-tls
JOB_LABEL = "elastic-harness.io/job-id"  # on this job's pods only: what the NetworkPolicy admits

# Object names get suffixes ("-worker", "-etcd-client") and StatefulSet pods add "-N" and a
# revision hash label of their own; 40 characters leaves room under the 63-character limit.
_MAX_NAME = 40
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


class RenderError(HarnessError):
    """The job cannot be turned into Kubernetes manifests as asked."""


@dataclass(frozen=True)
class Names:
    """The name of every object one job renders to."""

    base: str

    @property
    def config(self) -> str:
        return f"{self.base}-job"

    @property
    def volume_claim(self) -> str:
        return f"{self.base}-data"

    @property
    def worker(self) -> str:
        return f"{self.base}-worker"

    @property
    def etcd(self) -> str:
        return f"{self.base}-etcd"

    @property
    def etcd_client(self) -> str:
        return f"{self.base}-etcd-client"

    @property
    def key_secret(self) -> str:
        return f"{self.base}-key"

    @property
    def etcd_tls_secret(self) -> str:
        return f"{self.base}-etcd-tls"

    @property
    def etcd_client_tls_secret(self) -> str:
        return f"{self.base}-etcd-client-tls"


@dataclass(frozen=True)
class Target:
    """Everything a renderer reads: the validated spec plus where and what to deploy."""

    spec: JobSpec
    names: Names
    image: str
    namespace: str | None
    # ConfigMap key -> path under JOB_DIR, when a shipped file lives in a subdirectory (a
    # package beside the script); empty: every key is its own file name.
    config_paths: tuple[tuple[str, str], ...] = ()


def names_for(spec: JobSpec) -> Names:
    """Kubernetes names from ``spec.name``: lower case, '_' and '.' become '-'."""
    base = spec.name.lower().replace("_", "-").replace(".", "-")
    if not _DNS1035.match(base) or len(base) > _MAX_NAME:
        raise RenderError(
            f"job name '{spec.name}' cannot name Kubernetes objects (as '{base}')",
            f"use at most {_MAX_NAME} characters, starting with a letter and ending with a "
            "letter or digit, e.g. --set name=my-job",
        )
    return Names(base)


def labels(target: Target, component: str | None = None) -> dict:
    """Labels on every object of this job; ``component`` narrows to workers or etcd."""
    out = {
        "app.kubernetes.io/name": "elastic-harness",
        "app.kubernetes.io/instance": target.names.base,
    }
    if component:
        out["app.kubernetes.io/component"] = component
    return out


def job_id(target: Target) -> str:
    """The id every pod of this job shares and no other workload's pod carries: the
    rendezvous id (``submit`` pins a fresh one per submission), else the job name."""
    return target.spec.rendezvous.id or target.names.base


def pod_labels(target: Target, component: str) -> dict:
    """A pod template's labels: the selector's plus ``JOB_LABEL`` (kept out of selectors,
    which cannot change, so a resubmission may carry a new id)."""
    return {**labels(target, component), JOB_LABEL: job_id(target)}


def metadata(target: Target, name: str, component: str | None = None) -> dict:
    meta: dict = {"name": name}
    if target.namespace:
        meta["namespace"] = target.namespace
    meta["labels"] = {
        **labels(target, component),
        "app.kubernetes.io/managed-by": "elastic-harness",
    }
    return meta


def obj(api_version: str, kind: str, meta: dict, **body: object) -> dict:
    """One manifest with the usual key order: apiVersion, kind, metadata, then the body."""
    return {"apiVersion": api_version, "kind": kind, "metadata": meta, **body}
