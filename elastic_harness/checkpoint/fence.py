"""The generation fence: only the newest worker generation may commit or purge checkpoints.

``generation.json`` at the checkpoint root holds a counter and a random token. Each worker
generation bumps it when it restores, or, one that restores nothing (the survivors that
finished the step in flight in place), before its first save (rank 0 writes, every rank reads
it back: that read also proves all ranks see the same directory). Before committing a checkpoint, setting one
aside or removing a stale directory a save is about to reuse, rank 0 re-reads it: if another
generation has bumped it since, this one is stale (for example a partitioned node that did
not notice the job restarted without it) and its commit is refused. One read per save: the
purge that follows a commit relies on the commit's read, and a save's start reads nothing,
so a stale generation learns it at its next commit (and remembers: it writes nothing more).
What remains between the check and the write is a window of one small write; an old
generation can at worst commit a checkpoint of its own, complete and verified, or leave the
files of one uncommitted save (the new generation's retention removes them), never remove
the new generation's.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from elastic_harness.checkpoint.lock import RootFiles

GENERATION_FILE = "generation.json"


@dataclass(frozen=True)
class Generation:
    number: int
    token: str


def read(store: RootFiles) -> Generation | None:
    """The current generation; None if none was written or it cannot be parsed.

    ``OSError`` other than a missing file propagates (the caller decides what it means).
    """
    try:
        raw = json.loads(store.read_root(GENERATION_FILE))
        return Generation(int(raw["number"]), str(raw["token"]))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        return None


def bump(store: RootFiles, job: str) -> Generation:
    """Start a new generation (rank 0, at restore): the old number plus one, a fresh token."""
    current = read(store)
    new = Generation((current.number if current else 0) + 1, uuid.uuid4().hex)
    store.write_root(GENERATION_FILE, json.dumps({"number": new.number, "token": new.token, "job": job}).encode())
    return new


def superseded(ours: Generation | None, seen: Generation | None) -> str:
    """Pure: why generation ``ours`` may no longer commit ("" if it still may)."""
    if ours is None or seen == ours:
        return ""
    if seen is None:
        return "the generation record in the checkpoint directory is gone"
    return f"a newer worker generation ({seen.number}) has started since this one ({ours.number})"
