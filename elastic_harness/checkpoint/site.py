"""What the checkpoint manager's parts share: where they work, and their generation's tenure there.

The manager is four objects by job (``manager``: the saver and how the four are built;
``restorer``, ``verifier``, ``purger``). Each is given the same ``Site``, a frozen value: the
storage, the ranks that act together (``collective.Ranks``: rank, world size, the
checkpoint process group), the event log, the job's identity and key, how progress is
reported and the clock. They also share one ``Tenure``, the only state they share: the
generation this worker generation joined in the checkpoint directory (the fence), why it
was found superseded, and the steps being loaded or written, which the purger never
removes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from elastic_harness.checkpoint import collective, fence
from elastic_harness.checkpoint.progress import Ticker
from elastic_harness.checkpoint.storage import Storage
from elastic_harness.errors import os_reason

# DCP's CheckpointException derives from BaseException: name it explicitly.
SAVE_ERRORS = (Exception, CheckpointException)
FIX_STORAGE = "free space or fix permissions on the checkpoint directory, then re-run to resume"


@dataclass(frozen=True)
class Site:
    """Where the parts work, the same for all of them: one per manager, every rank its own."""

    storage: Storage
    ranks: collective.Ranks  # this rank, the world size, the checkpoint group (a dedicated gloo group)
    events: Any  # the event log: rank 0 narrates (the parts emit only there)
    # What a checkpoint records as its producer (``task``, ``parallelism``, ``job``); ``job``
    # also names the generation in the fence, and a checkpoint of another task is refused.
    info: dict
    # The job's key (``jobkey``): commits are signed with it and a checkpoint not signed with
    # it is refused before it is read. None: unsigned, everything trusted (tests, benches).
    key: bytes | None = None
    # Called (throttled to once a second, on the calling thread) while a blocking call moves bytes.
    ticker: Ticker = field(default_factory=lambda: Ticker(None))
    clock: Callable[[], float] = time.time


class Tenure:
    """This worker generation in the checkpoint directory, shared by the parts: the fence it
    joined (``join``, once, every rank), whether a newer generation has superseded it
    (``superseded``, rank 0), and ``busy``: the steps being loaded (``restorer``) or written
    (``manager.Saver``), which the purger never removes."""

    def __init__(self, site: Site) -> None:
        self.site = site
        self.generation: fence.Generation | None = None
        self.fenced = ""  # rank 0: why this generation was found superseded (for good)
        self.busy: set[int] = set()  # steps being loaded or written: never purged

    def join(self) -> None:
        """Start this worker generation in the checkpoint directory (the fence), once; every
        rank. ``restore`` calls it; call it first when the state is restored from memory.
        ``Saver.save`` calls it before a generation's first write, for a generation that restored
        nothing (the survivors that finished the step in flight in place)."""
        if self.generation is None:
            ranks = self.site.ranks
            self.generation = collective.join_generation(
                self.site.storage, str(self.site.info.get("job", "")), rank=ranks.rank, world_size=ranks.world_size,
                group=ranks.group)

    def superseded(self) -> str:
        """Rank 0: why this generation may no longer change the directory ("" if it may).
        Reads the fence until it says so once: a generation never becomes current again."""
        if self.fenced:
            return self.fenced
        try:
            self.fenced = fence.superseded(self.generation, fence.read(self.site.storage) if self.generation else None)
        except OSError as e:
            return f"the generation record cannot be read: {os_reason(e)}"
        return self.fenced
