"""The agent's side of the in-memory tier: two memory slots per local rank.

Each rank has ``SLOTS_PER_RANK`` slots for its own snapshots, then ``BUDDY_SLOTS`` for the
copies it keeps of another node's rank (sharded state only; unused slots take no memory).
Each slot is an anonymous memory file (``memfd_create``), empty until a worker writes its
snapshot into it (the worker sizes it). The agent only holds the descriptors: it never reads
or writes them. Workers reach them as ``/proc/AGENT_PID/fd/N`` (same user, same node), so a
slot outlives the worker that wrote it, and the kernel frees all of them when the agent
exits, however it exits: no file in ``/dev/shm`` to clean up, ever.

Call order: ``HostSlots.create(nproc)`` once, before the first worker starts (the value of
``describe()`` goes into the workers' environment, ``launch.env.MEMORY_VAR``); ``close()``
once at the end (optional: exit frees them too).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

SLOTS_PER_RANK = 2  # write one while the other holds the last published snapshot
BUDDY_SLOTS = 2  # then a copy of another node's rank's snapshot (``buddy``): receive one, keep one


@dataclass
class HostSlots:
    pid: int
    fds: list[list[int]]  # per local rank, its slots' descriptors

    @classmethod
    def create(cls, nproc: int, slots: int = SLOTS_PER_RANK) -> HostSlots:
        fds = [[os.memfd_create(f"elastic-harness-rank{lr}-slot{s}") for s in range(slots)]
               for lr in range(nproc)]
        return cls(os.getpid(), fds)

    def describe(self) -> str:
        return describe(self.pid, self.fds)

    def close(self) -> None:
        for fd in (fd for rank in self.fds for fd in rank):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []


def describe(pid: int, fds: list[list[int]]) -> str:
    """Pure: ``PID:FD,FD;FD,FD`` (slots of local rank 0; of local rank 1; ...)."""
    return f"{pid}:" + ";".join(",".join(str(fd) for fd in rank) for rank in fds)


def slot_paths(value: str, local_rank: int) -> list[str]:
    """Pure: the ``/proc`` paths of ``local_rank``'s slots in ``describe()``'s value; [] if none."""
    pid, sep, ranks = value.partition(":")
    if not sep or not pid.isdigit():
        return []
    per_rank = ranks.split(";")
    if local_rank >= len(per_rank) or not per_rank[local_rank]:
        return []
    return [f"/proc/{pid}/fd/{fd}" for fd in per_rank[local_rank].split(",")]
