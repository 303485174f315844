"""The processes of a simulated host (its own pid namespace), seen from the machine's.

A node started by ``simhost`` reports pids of its own namespace (its agent is pid 2 there,
its workers small numbers too); the ``run`` that fires faults lives in the machine's
namespace, where those numbers name other processes. This module finds a host's processes
and translates its pids, from ``/proc`` (``NSpid``: a process's pid in each namespace from
the reader's down to its own). Standard library only; Linux.
"""

from __future__ import annotations

import os
from collections.abc import Iterator


def namespace(pid: int) -> int | None:
    """The pid namespace (its inode) of process ``pid``; None if it is gone."""
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None


def _status(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/status") as f:
            return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
    except OSError:
        return {}


def inner_pid(status: dict[str, str]) -> int | None:
    """Pure: a process's pid in its own namespace, from its ``/proc/PID/status`` fields."""
    ids = status.get("NSpid", "").split()
    return int(ids[-1]) if ids and ids[-1].isdigit() else None


def _pids() -> Iterator[int]:
    for name in os.listdir("/proc"):
        if name.isdigit():
            yield int(name)


def members(ns: int) -> dict[int, int]:
    """The processes of pid namespace ``ns``: their pid there -> their pid here."""
    out = {}
    for pid in _pids():
        if namespace(pid) == ns:
            inner = inner_pid(_status(pid))
            if inner is not None:
                out[inner] = pid
    return out


def children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (pids here)."""
    out = []
    for other in _pids():
        if _status(other).get("PPid", "").strip() == str(pid):
            out.append(other)
    return sorted(out)


def init_of(launcher: int) -> int | None:
    """The init (pid 1 of the new namespace) that ``unshare --fork`` (pid ``launcher``) started."""
    mine = namespace(launcher)
    for child in children(launcher):
        ns = namespace(child)
        if ns is not None and ns != mine:
            return child
    return None
