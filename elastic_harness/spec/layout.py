"""The job's ``parallelism``: ``ddp``, ``fsdp`` or a mesh mapping, read and checked here.

A mesh is ``{replicate: auto, shard: S, tensor: T}`` (torchtitan's HSDP + TP order, outer
to inner). ``shard x tensor`` stays within a node, so it must divide ``nproc_per_node``;
``replicate`` follows the nodes (``auto``, the default: ``nodes x nproc_per_node / (S x T)``)
or is a fixed number, which then pins the node count.

Pure: no torch. The one home of "does this layout fit"; ``runtime.topology`` builds its
degrees through ``mesh_degrees`` and the spec checks every node count in
``nodes.min..nodes.max`` with the same function, so a job that validates also starts.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from elastic_harness.errors import SpecError, SpecErrors

DIMS = ("replicate", "shard", "tensor")  # outer to inner
AUTO = "auto"
KINDS = ("ddp", "fsdp")
_EXAMPLE = "{replicate: auto, shard: 2, tensor: 2}"


def normalize(value: Any, path: str = "parallelism") -> str | dict:
    """``ddp``, ``fsdp``, or the mesh as a plain dict with every dimension named (``replicate``
    ``auto`` or an int, ``shard`` and ``tensor`` ints, 1 when left out). Every problem of a
    mapping is reported at once (``SpecErrors``)."""
    if isinstance(value, str):
        if value in KINDS:
            return value
        near = difflib.get_close_matches(value, KINDS, n=1)
        raise SpecError(path, f"'{value}' is not a layout",
                        f"did you mean '{near[0]}'?" if near else f"use ddp, fsdp, or a mesh such as {_EXAMPLE}")
    if not isinstance(value, Mapping):
        raise SpecError(path, f"{value!r} is not a layout", f"use ddp, fsdp, or a mesh such as {_EXAMPLE}")
    problems: list[SpecError] = []
    for key in value:
        if key not in DIMS:
            near = difflib.get_close_matches(str(key), DIMS, n=1)
            problems.append(SpecError(f"{path}.{key}", f"'{key}' is not a mesh dimension",
                                      f"did you mean '{near[0]}'?" if near else f"use {', '.join(DIMS)}"))
    out: dict[str, Any] = {}
    for dim in DIMS:
        degree = value.get(dim, AUTO if dim == "replicate" else 1)
        if dim == "replicate" and degree == AUTO:
            out[dim] = AUTO
        elif isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
            fix = ("give auto (it follows the node count) or a whole number of at least 1"
                   if dim == "replicate" else "give a whole number of at least 1 (only replicate may be auto)")
            problems.append(SpecError(f"{path}.{dim}", f"{degree!r} is not a degree", fix))
        else:
            out[dim] = degree
    if problems:
        raise problems[0] if len(problems) == 1 else SpecErrors(problems)
    return out


def mesh_degrees(mesh: Mapping[str, Any], world_size: int, nproc_per_node: int,
                 nodes: int) -> tuple[int, int, int]:
    """``(replicate, shard, tensor)`` of a mesh over ``nodes`` nodes of ``nproc_per_node``
    (``world_size`` processes in all); ``SpecError`` naming the fix when it cannot fit."""
    mesh = normalize(mesh)
    shard, tensor = mesh["shard"], mesh["tensor"]
    within = shard * tensor
    if nproc_per_node % within:
        raise SpecError("parallelism", f"shard {shard} x tensor {tensor} = {within} does not divide "
                        f"nproc_per_node {nproc_per_node}: the inner dimensions stay within a node",
                        f"pick shard x tensor among the divisors of {nproc_per_node}, or change nproc_per_node")
    if world_size != nodes * nproc_per_node:
        raise SpecError("parallelism", f"a mesh needs the same processes on every node: {world_size} "
                        f"processes on {nodes} nodes of {nproc_per_node}",
                        "give every node the same nproc_per_node")
    replicate = world_size // within if mesh["replicate"] == AUTO else mesh["replicate"]
    if replicate * within != world_size:
        raise SpecError("parallelism.replicate", f"replicate {replicate} x shard {shard} x tensor "
                        f"{tensor} is {replicate * within}, not the {world_size} processes of {nodes} "
                        f"node(s)", "set replicate: auto (it follows the node count)")
    return replicate, shard, tensor


def fit_problems(parallelism: str | dict, nodes_min: int, nodes_max: int,
                 nproc_per_node: int) -> list[SpecError]:
    """Why ``parallelism`` cannot run at some node count in ``nodes_min..nodes_max`` (one
    error per distinct reason; none for ``ddp``/``fsdp``, which fit any world)."""
    if not isinstance(parallelism, Mapping):
        return []
    found: dict[str, SpecError] = {}
    for nodes in sorted({nodes_min, nodes_max}):
        try:
            mesh_degrees(parallelism, nodes * nproc_per_node, nproc_per_node, nodes)
        except SpecError as e:
            found.setdefault(e.message, e)
    return list(found.values())


def dp_degree_at(parallelism: str | dict, nodes: int, nproc_per_node: int) -> int:
    """How many data-parallel ranks ``nodes`` nodes have (processes under ddp/fsdp)."""
    if not isinstance(parallelism, Mapping):
        return nodes * nproc_per_node
    return nodes * nproc_per_node // parallelism["tensor"]


def describe(parallelism: str | dict, nodes_min: int, nodes_max: int, nproc_per_node: int) -> str:
    """One line: the layout at the fewest and the most nodes (``elastic-harness spec``)."""
    if not isinstance(parallelism, Mapping):
        what = "replicas (DDP)" if parallelism == "ddp" else "FSDP2 shards"
        sizes = sorted({nodes_min * nproc_per_node, nodes_max * nproc_per_node})
        return f"layout: {parallelism}, {' .. '.join(map(str, sizes))} {what}"
    shapes = []
    for nodes in sorted({nodes_min, nodes_max}):
        r, s, t = mesh_degrees(parallelism, nodes * nproc_per_node, nproc_per_node, nodes)
        shapes.append(f"replicate {r} x shard {s} x tensor {t}")
    dp = sorted({dp_degree_at(parallelism, n, nproc_per_node) for n in (nodes_min, nodes_max)})
    return (f"layout: mesh {' .. '.join(shapes)} (replicate follows the nodes; data-parallel "
            f"degree {' .. '.join(map(str, dp))}; mesh dims dp_replicate, dp_shard, tp)")
