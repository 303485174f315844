"""Collective steps of a resume: every rank calls each function, in the same order.

Nothing here raises on one rank only: storage errors become values that the ranks
exchange, so no rank leaves the collective sequence while the others wait in it (they
would otherwise hang until the process group's timeout).

``join_generation`` starts this worker generation in the checkpoint directory (the fence)
and proves that every rank sees the same directory. ``agreed_verdict`` verifies one
checkpoint with the work split over all ranks (``integrity.shares``), in rounds of at most
``round_bytes`` per rank, so no rank waits in a collective longer than one round of
another rank's reading, however big the checkpoint.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastic_harness.checkpoint import fence, integrity
from elastic_harness.checkpoint.storage import Storage
from elastic_harness.errors import CheckpointError, os_reason

ROUND_BYTES = 256 << 20


def broadcast(value: Any, group: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


def all_gather(value: Any, group: Any, world_size: int) -> list[Any]:
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, value, group=group)
    return out


def all_min(value: int, group: Any) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def all_ok(ok: bool, group: Any) -> bool:
    return all_min(int(ok), group) == 1


def broadcast_ints(values: list[int], group: Any) -> list[int]:
    """Rank 0's ``values`` (64-bit integers; every rank passes as many) on every rank: one
    tensor broadcast, where ``broadcast`` of an object is two and a pickle."""
    t = torch.tensor(values, dtype=torch.int64)
    dist.broadcast(t, group=group, group_src=0)
    return t.tolist()


ACTIONS = ("go", "skipped", "fenced", "error")


def decision(said: tuple[str, str] | None, group: Any) -> tuple[str, str]:
    """Rank 0's ``(action, detail)`` (an ``ACTIONS`` entry, and why), the same on every rank
    (every rank calls it; the others pass None): one tensor broadcast when it is "go" (every
    save asks, and an async save asks from its background thread, whose collectives wait for
    both ranks' threads to be scheduled), the words in a second only otherwise."""
    action, detail = said if said is not None else ("go", "")
    (code,) = broadcast_ints([ACTIONS.index(action)], group)
    if code == 0:
        return "go", ""
    return ACTIONS[code], broadcast(detail, group)


def generation_ints(g: fence.Generation | None) -> list[int]:
    """Pure: a generation as three integers (its number, its 128-bit token in two halves);
    ``[-1, 0, 0]`` for none."""
    if g is None:
        return [-1, 0, 0]
    raw = bytes.fromhex(g.token)
    return [g.number, int.from_bytes(raw[:8], "big", signed=True), int.from_bytes(raw[8:], "big", signed=True)]


def generation_of(ints: list[int]) -> fence.Generation | None:
    """Pure: ``generation_ints`` read back."""
    number, high, low = ints
    if number < 0:
        return None
    return fence.Generation(number, (high.to_bytes(8, "big", signed=True) + low.to_bytes(8, "big", signed=True)).hex())


def join_generation(storage: Storage, job: str, *, rank: int, world_size: int, group: Any) -> fence.Generation:
    """Rank 0 bumps the generation; every rank reads it back. Raises ``CheckpointError`` on
    every rank if rank 0 cannot write it or any rank does not see what rank 0 wrote.

    Two tensor collectives when all is well (the generation, whether every rank saw it);
    the words of a failure travel in a third, only then: every worker of every restart
    passes here, all of them at once."""
    mine: fence.Generation | None = None
    failed = ""
    if rank == 0:
        try:
            storage.ensure()
            mine = fence.bump(storage, job)
        except OSError as e:
            failed = f"cannot write {storage.root}/{fence.GENERATION_FILE}: {os_reason(e)}"
    mine = generation_of(broadcast_ints(generation_ints(mine), group))
    if mine is None:
        raise CheckpointError(broadcast(failed, group),
                              "fix the permissions of checkpoint.dir, or point it at writable storage")
    try:
        seen = fence.read(storage) == mine
    except OSError:
        seen = False
    if all_ok(seen, group):
        return mine
    views = all_gather((seen, socket.gethostname()), group, world_size)
    blind = [f"rank {r} on {host}" for r, (ok, host) in enumerate(views) if not ok]
    if blind:
        raise CheckpointError(
            f"{', '.join(blind[:4])} cannot see the checkpoint directory {storage.root} that rank 0 "
            "writes (not shared between nodes?)",
            "put checkpoint.dir on storage every node mounts at the same path (NFS, Lustre, a "
            "ReadWriteMany volume) or on s3://",
        )
    return mine


def _head(storage: Storage, name: str, mode: str, key: bytes | None) -> tuple[dict | None, integrity.Verdict]:
    """Rank 0: the manifest, its signature (``integrity.authenticate``, in every mode) and
    the size check (one listing), as values."""
    manifest, verdict = integrity.load_manifest(storage, name)
    if manifest is None:
        return manifest, verdict
    verdict = integrity.authenticate(storage, name, manifest, key)
    if not verdict.ok or mode == "none":
        return manifest, verdict
    try:
        return manifest, integrity.check_sizes(manifest, storage.files(name))
    except OSError as e:
        return None, integrity.Verdict(False, f"{name} cannot be listed ({os_reason(e)})", "unreadable")


@dataclass(frozen=True)
class Ranks:
    """The ranks that act together: this one, how many, and their process group."""

    rank: int
    world_size: int
    group: Any


def agreed_verdict(storage: Storage, name: str, mode: str, ranks: Ranks, *, round_bytes: int = ROUND_BYTES,
                   on_bytes: Callable[[int], None] | None = None, key: bytes | None = None) -> integrity.Verdict:
    """Verify ``name`` on all ``ranks`` together (its signature with the job's ``key`` first);
    every rank returns the same verdict."""
    rank, world_size, group = ranks.rank, ranks.world_size, ranks.group
    manifest, verdict = broadcast(_head(storage, name, mode, key) if rank == 0 else None, group)
    if not verdict.ok or mode != "full":
        return verdict
    sizes = {f: w["size"] for f, w in manifest["files"].items()}
    parts = integrity.shares(sizes, world_size)
    check = integrity.ShareCheck(storage, name, manifest, parts[rank], on_bytes)
    for _ in range(integrity.rounds_needed(sizes, parts, round_bytes)):
        if not all_ok(check.advance(round_bytes), group):
            break
    verdicts = all_gather(check.verdict, group, world_size)
    return next((v for v in verdicts if not v.ok), integrity.Verdict(True))
