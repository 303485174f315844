"""Pure: what Slurm's environment says about an agent's rendezvous, as defaults.

Inside an allocation (``srun``), each task sees ``SLURM_JOB_ID``, ``SLURM_JOB_NODELIST``
(compressed, e.g. ``gpu[01-04,07]``), ``SLURM_NODEID`` (this node's index in the allocation)
and, after a requeue, ``SLURM_RESTART_COUNT``. ``node_options`` uses them below flags and
``PET_*`` variables, so a hand-written ``srun elastic-harness agent job.yaml`` rendezvouses
on the allocation's first node with an id of its own:

- rendezvous id: ``slurm-<job id>-<restart count>`` (a requeued attempt gets a new id: an
  etcd rendezvous that finished stays closed for hours);
- endpoint (c10d): the first node of the allocation, torchrun's default port;
- store host (c10d): node 0, when the endpoint is the first node;
- node name (``commands/agent.py``): ``SLURM_NODEID``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

_RANGE = re.compile(r"^(?P<prefix>[^\[,]*)\[(?P<body>[^\]]+)\](?P<suffix>[^,]*)")


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: ``a[01-03,7],b`` -> ``a01``."""
    nodelist = nodelist.strip()
    m = _RANGE.match(nodelist)
    if m is None:
        return nodelist.split(",", 1)[0]
    first = m["body"].split(",", 1)[0].split("-", 1)[0]
    return f"{m['prefix']}{first}{m['suffix']}"


def in_allocation(environ: Mapping[str, str]) -> bool:
    return bool(environ.get("SLURM_JOB_ID") and environ.get("SLURM_JOB_NODELIST"))


def rdzv_id(environ: Mapping[str, str]) -> str:
    if not in_allocation(environ):
        return ""
    return f"slurm-{environ['SLURM_JOB_ID']}-{environ.get('SLURM_RESTART_COUNT') or 0}"


def endpoint_host(environ: Mapping[str, str]) -> str:
    return first_host(environ["SLURM_JOB_NODELIST"]) if in_allocation(environ) else ""


def is_store_host(environ: Mapping[str, str], endpoint: str) -> bool | None:
    """c10d: whether this task's node hosts the store at ``endpoint`` (None: cannot tell)."""
    host = endpoint.rpartition(":")[0]
    if not in_allocation(environ) or "SLURM_NODEID" not in environ or host != endpoint_host(environ):
        return None
    return environ["SLURM_NODEID"] == "0"


def node_name(environ: Mapping[str, str]) -> str:
    return environ.get("SLURM_NODEID", "") if in_allocation(environ) else ""
