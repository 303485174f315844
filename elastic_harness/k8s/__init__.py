"""Pure rendering of a ``JobSpec`` to Kubernetes manifests (plain dicts); no cluster access.

``render(spec, flavor, image, namespace)`` returns the objects in apply order;
``manifest_files`` lays them out as a kustomize directory (what ``k8s/`` holds) and
``to_yaml`` as one multi-document stream. This package imports only ``spec``, ``errors``
and ``exitcodes``: never torch, never the worker side.

Flavors (k8s/DEPLOY.md says which to choose)
  ``trainjob``    a Kubeflow Trainer v2 ``TrainJob`` and the ``TrainingRuntime`` it
                  references (JobSet underneath; ``k8s.trainjob``): Trainer starts
                  ``nodes.max`` pods; the agents rendezvous through a rendered 3-member etcd
                  (its v3 API), so nodes join and leave without an operator's elastic policy.
  ``pytorchjob``  a Kubeflow training-operator v1 ``PyTorchJob`` with ``elasticPolicy``
                  (needs the operator installed). Backend c10d: the store runs in the first
                  worker's agent (``<job>-worker-0:deploy.rdzv_port``); etcd: a
                  three-member etcd is rendered too.
  ``plain``       no operator: an etcd StatefulSet (3 members, etcd 3.6: the v3 API only),
                  workers as a StatefulSet of ``nodes.max`` pods, always the etcd backend (a
                  c10d store inside one worker would die with that worker).
All add: the job ConfigMap, a ReadWriteMany claim (unless checkpoints go to s3://), a
NetworkPolicy, a PodDisruptionBudget (``minAvailable: nodes.min``).

Contract with ``elastic-harness agent`` (``elastic_harness/commands/agent.py``)
  The node container is named ``pytorch`` (``node`` in the trainjob flavor) and runs
      elastic-harness agent /etc/elastic-harness/job.yaml [FLAGS]
  where job.yaml is ``dump_job(spec)`` from the ConfigMap. FLAGS, always:
      --run-dir /mnt/elastic-harness/runs/<spec.name>   --endpoint-port <deploy.endpoint_port>
  plain and trainjob flavors, also:
      --rdzv-backend etcd  --rdzv-endpoint <job>-etcd-client:2379  --rdzv-id <id>
      --nnodes MIN:MAX  --nproc-per-node N  --max-restarts N  --rdzv-conf <https + client cert>
  pytorchjob flavor: no rendezvous flags; the operator sets PET_NNODES (MIN:MAX),
  PET_RDZV_ENDPOINT, PET_RDZV_BACKEND, PET_RDZV_ID, PET_MAX_RESTARTS, PET_NPROC_PER_NODE.
  The agent takes each value from its flag, else its PET_* variable, else the job file.
  It answers GET /healthz on the endpoint port (startup, liveness and readiness probes) from
  start-up on, rendezvous included. On SIGTERM it drains within timeouts.shutdown_grace
  (the pod allows that plus deploy.grace_margin) and exits 143, which the operator's
  ExitCode restart policy retries (as it retries 200, an infrastructure failure; see
  ``exitcodes``); the trainjob flavor's Job ignores both exits and replaces the pod. The rendezvous id is ``rendezvous.id``, else the Kubernetes job name: every
  pod must agree on it (``elastic-harness submit --scheduler k8s`` pins a fresh one).

Limits: the StatefulSet restarts pods that exit 0, so delete the plain job when it is done;
object names are baked into flags, so rename through the job's ``name``, not kustomize's
``namePrefix``.

Secrets (docs/security.md): nothing secret is rendered. The pods need
``<job>-key`` (key ``job.key``: the job's HMAC key, mounted at /etc/elastic-harness/key and
named by ``ELASTIC_HARNESS_KEY_FILE``); with an etcd, ``<job>-etcd-tls`` (server and peer
certificate, ``tls.crt``/``tls.key``/``ca.crt``) and ``<job>-etcd-client-tls`` (the agents'
client certificate, passed as rendezvous settings: https, ``--client-cert-auth``). The
NetworkPolicy admits only pods labelled with this job's id (``elastic-harness.io/job-id``).
"""

from elastic_harness.k8s.common import FLAVORS, RenderError
from elastic_harness.k8s.render import DEFAULT_IMAGE, manifest_files, render, to_yaml

__all__ = ["DEFAULT_IMAGE", "FLAVORS", "RenderError", "manifest_files", "render", "to_yaml"]
