"""The ``DeviceMesh`` of a mesh layout, built once from the ``Topology``, and what uses it.

Dimension names follow torchtitan: ``dp_replicate`` (HSDP replicas, the elastic dimension:
it follows the nodes), ``dp_shard`` (FSDP2 shards within a node) and ``tp`` (tensor
parallelism, innermost: a tensor group is consecutive ranks of one node). Every dimension is
kept, size 1 included, so ``mesh["tp"]`` and ``mesh["dp_shard"]`` exist in every mesh layout
and a script needs no case for a degree of 1. Two derived meshes, named for what they are for:

- ``mesh["dp"]``: the data-parallel ranks flattened (``dp_replicate x dp_shard``), e.g. to
  all-reduce a metric over the ranks that read different samples;
- ``fsdp_mesh(mesh)``: what ``fully_shard(..., mesh=)`` wants: 2-D ``(dp_replicate,
  dp_shard)`` (HSDP: shard inside, replicate across) when there is more than one replica,
  else 1-D ``dp_shard``.

Building the mesh is collective (it creates a process group per dimension group): ``Run``
does it once in ``init`` on every rank, in the same order, never lazily.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

from torch import nn

from elastic_harness.errors import TaskError
from elastic_harness.runtime.topology import Topology
from elastic_harness.torchcompat.nn import flatten_mesh

MESH_DIMS = ("dp_replicate", "dp_shard", "tp")  # Topology.DIMS, outer to inner
DP = "dp"  # the flattened data-parallel dimension


def build_mesh(topology: Topology, device_type: str) -> Any:
    """The 3-D ``DeviceMesh`` of ``topology`` (ranks row-major, as ``Topology`` numbers them),
    with the flattened ``dp`` mesh registered on it (where this torch can: ``torchcompat.nn``)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, topology.shape, mesh_dim_names=MESH_DIMS)
    flatten_mesh(mesh["dp_replicate", "dp_shard"], DP)  # torch has no public name for this yet (2.15)
    return mesh


def fsdp_mesh(mesh: Any) -> Any:
    """The mesh ``fully_shard`` shards over: HSDP's 2-D mesh with replicas, else ``dp_shard``."""
    return mesh["dp_replicate", "dp_shard"] if mesh["dp_replicate"].size() > 1 else mesh["dp_shard"]


def check_plan(model: nn.Module, plan: Mapping[str, Any], where: str) -> None:
    """A tensor-parallel plan's keys (``parallelize_module``'s, ``*`` allowed per level) must
    each name a module ``model`` has: torch only warns and skips an unknown key, which would
    leave that layer replicated and the run silently different. ``TaskError``, one line."""
    names = [name for name, _ in model.named_modules() if name]
    missing = [key for key in plan if key and not _resolves(key, names)]
    if missing:
        raise TaskError(f"{where}: the tensor-parallel plan names module(s) the model lacks: "
                        f"{', '.join(missing)}",
                        "name modules as model.named_modules() spells them ('layers.*.attention.wq')")


def _resolves(key: str, names: list[str]) -> bool:
    parts = key.split(".")
    return any(len(n.split(".")) == len(parts) and all(fnmatch.fnmatchcase(a, b) for a, b in
                                                       zip(n.split("."), parts, strict=True)) for n in names)


def check_divides(sizes: Mapping[str, int], tensor: int, where: str) -> None:
    """Every dimension a tensor-parallel plan splits (``{"heads": 4, "hidden": 256}``) must
    divide by the tensor degree, or the layout cannot map onto the model (nor a checkpoint of
    it): ``TaskError`` naming the dimension, before any state is loaded."""
    bad = [f"{name} {size}" for name, size in sizes.items() if size % tensor]
    if bad:
        raise TaskError(f"{where}: tensor degree {tensor} does not divide {', '.join(bad)}",
                        "pick parallelism.tensor among the divisors of these sizes, or change the model")


def parallelize(model: nn.Module, mesh: Any, task: Any, topology: Topology, where: str) -> nn.Module:
    """The task path on a mesh layout: the task's tensor-parallel plan on ``mesh["tp"]`` (its
    ``parallelize(model, mesh)``, required when ``tensor > 1``), then FSDP2 over the
    data-parallel ranks: each of the task's ``shard_units`` (e.g. blocks), then the root."""
    from torch.distributed.fsdp import fully_shard

    hook = getattr(task, "parallelize", None)
    if topology.tensor > 1:
        if not callable(hook):
            raise TaskError(f"parallelism.tensor is {topology.tensor} but {where} has no "
                            "parallelize(model, mesh)", "add a tensor-parallel plan to the task, "
                            "or set parallelism.tensor: 1")
        model = hook(model, mesh) or model
    dp = fsdp_mesh(mesh)
    units = getattr(task, "shard_units", None)
    for unit in units(model) if units else []:
        fully_shard(unit, mesh=dp)
    fully_shard(model, mesh=dp)
    return model
