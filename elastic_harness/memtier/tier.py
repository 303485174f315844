"""The worker's side of the in-memory tier: save a snapshot, restore the newest common one.

Call order (every rank of a generation, same order): ``restore(state)`` once, before
training and before any storage restore (it is collective: ``gather(value)`` returns every
rank's value, in rank order, e.g. an all-gather on the checkpoint group); then
``save(step, state)`` after the steps ``cadence`` names (no collective; each rank
writes its own slot). ``close()`` at the end.

``restore`` uses memory only when every rank holds a published snapshot of the same step
written at this world size by this rank; then no storage is read. Otherwise every rank's
slots are unpublished (they belong to a lineage this generation does not continue) and the
caller restores from storage. A rank that cannot open its slots takes part with none, so
the ranks always agree. Nothing calls the live state's ``state_dict()`` before the ranks
agreed on a step (for an optimizer without state, that call runs a zero step that creates
it, which must not happen on some ranks only, nor before a fresh start). Once they agreed,
a snapshot that does not fit the state's layout, or fails to load, stops the generation
(its state may be half-filled): every slot is unpublished first, so the next restart
restores from storage.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elastic_harness.memtier import snapshot
from elastic_harness.memtier.host import slot_paths
from elastic_harness.memtier.region import Region
from elastic_harness.memtier.slots import (
    HEADER_SIZE,
    Header,
    newest_common,
    next_slot,
    usable_steps,
)

SLACK = 4096


@dataclass(frozen=True)
class Restored:
    step: int
    seconds: float


Gather = Callable[[Any], list[Any]]


class MemoryTier:
    def __init__(self, regions: list[Region], *, rank: int, world_size: int, gather: Gather,
                 warn: Callable[[str], None]) -> None:
        self.regions, self.rank, self.world_size, self.gather = regions, rank, world_size, gather
        self._warn = warn  # every rank may report its own trouble
        self._last: int | None = None  # the slot holding this rank's newest snapshot
        self._views = [snapshot.Views() for _ in regions]

    @classmethod
    def open(cls, described: str, local_rank: int, *, rank: int, world_size: int, gather: Gather,
             warn: Callable[[str], None]) -> MemoryTier:
        """This rank's slots from the agent's description (``host.describe``)."""
        regions: list[Region] = []
        try:
            for path in slot_paths(described, local_rank):
                regions.append(Region(path))
        except OSError as e:
            for region in regions:
                region.close()
            regions = []
            warn(f"rank {rank}: cannot open its in-memory checkpoint slots ({e.strerror or e!r}); "
                 "restarts restore from storage")
        return cls(regions, rank=rank, world_size=world_size, gather=gather, warn=warn)

    def restore(self, state: dict[str, Any]) -> Restored | None:
        """Collective: fill ``state`` from the newest snapshot every rank holds, or None."""
        t0 = time.perf_counter()
        mine = self._usable() if self.regions else {}
        step = newest_common(self.gather(sorted(mine)))
        if step is None:
            self._unpublish_all()
            return None
        error = self._load(state, mine[step])
        errors = [f"rank {r}: {e}" for r, e in enumerate(self.gather(error)) if e]
        if errors:
            self._unpublish_all()
            raise RuntimeError(f"restoring step {step} from memory failed ({'; '.join(errors)}); "
                               "the next restart restores from storage")
        self._last = mine[step]
        return Restored(step, time.perf_counter() - t0)

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Snapshot ``state`` as ``step`` into the slot not holding this rank's newest one."""
        if not self.regions:
            return
        slot = next_slot(self._last, len(self.regions))
        region = self.regions[slot]
        try:
            cap = snapshot.capture(state)
            # Room to spare: the skeleton (plain values such as a learning rate) may grow a little.
            data = region.begin(HEADER_SIZE + cap.data_len + len(cap.skeleton) + SLACK)
            snapshot.write(cap, data, HEADER_SIZE, self._views[slot])
            region.publish(Header(True, step, self.world_size, self.rank, cap.data_len, len(cap.skeleton),
                                  cap.digest))
        except (OSError, snapshot.Unsupported, RuntimeError) as e:
            self._warn(f"rank {self.rank}: in-memory checkpoint at step {step} failed ({e!r:.200}); "
                       "the tier is off for this worker, restarts restore from storage")
            self._unpublish_all()
            self.close()
            return
        self._last = slot

    def close(self) -> None:
        for region in self.regions:
            region.close()
        self.regions = []

    def _usable(self) -> dict[int, int]:
        try:
            headers = [r.header() for r in self.regions]
        except OSError as e:
            self._warn(f"rank {self.rank}: cannot read its in-memory checkpoint slots ({e!r:.200})")
            return {}
        return usable_steps(headers, world_size=self.world_size, rank=self.rank)

    def _load(self, state: dict[str, Any], slot: int) -> str | None:
        """Fill ``state`` from ``slot``; why it failed, or None."""
        region = self.regions[slot]
        try:
            header = region.header()
            trees = snapshot.targets(state)
            data = region.data()
            skeleton = snapshot.read_skeleton(data, HEADER_SIZE, header.data_len, header.skeleton_len)
            misfit = snapshot.misfit(skeleton, trees)
            if misfit:
                return f"the snapshot of step {header.step} does not fit this state's layout ({misfit})"
            snapshot.restore_into(state, trees, skeleton, data, HEADER_SIZE)
        except Exception as e:  # noqa: BLE001 - reported to every rank, which then all stop
            return f"{e!r:.300}"
        return None

    def _unpublish_all(self) -> None:
        for region in self.regions:
            with contextlib.suppress(OSError):
                region.unpublish()
        self._last = None
