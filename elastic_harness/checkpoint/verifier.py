"""Which checkpoints may be used: the shared listing, agreed verdicts, and setting aside the rest.

Every rank calls ``shared_listing`` and ``verify`` together (collectives on the checkpoint
group); rank 0 alone lists the root, and alone reports and sets aside (``report_skipped``,
``report_unloadable``, ``quarantine``: ``quarantine`` moves a checkpoint where nothing loads
or counts it, unless this generation was superseded, ``site.Tenure``). ``ours`` says whether
a checkpoint is this job's, signed with its key: the saver sets aside one that is not when
it holds the name of a step it saves, and the purger neither counts nor removes one.
"""

from __future__ import annotations

from typing import Any

from elastic_harness.checkpoint import collective, integrity, layout, quarantine
from elastic_harness.checkpoint.site import FIX_STORAGE, Site, Tenure
from elastic_harness.errors import CheckpointError, os_reason
from elastic_harness.spec import CheckpointSpec


class Verifier:
    def __init__(self, site: Site, tenure: Tenure, policy: CheckpointSpec,
                 verify_round_bytes: int = collective.ROUND_BYTES) -> None:
        self.site, self.tenure, self.policy = site, tenure, policy
        self.storage, self.events, self.key = site.storage, site.events, site.key
        self.rank, self.group = site.ranks.rank, site.ranks.group
        self.verify_round_bytes, self._clock, self._ticker = verify_round_bytes, site.clock, site.ticker

    def report_unloadable(self, unloadable: list[tuple[str, str]], set_aside: bool) -> None:
        """Rank 0: checkpoints that verified but failed to load. They are set aside only when an
        older one loaded (the fault is theirs); if none loads, the fault may be this job's code
        or environment, and they stay where they are."""
        for name, why in unloadable if self.rank == 0 else ():
            if set_aside:
                self.quarantine(name, f"loading failed: {why}", "unloadable")
            else:
                self.events.emit("warning", message=f"skipping {name}: loading failed: {why} (left in place: "
                                 "no checkpoint loaded, the fault may not be the checkpoint's)")

    def shared_listing(self) -> dict[str, list[str]]:
        """Rank 0 lists the root; every rank gets the same listing (or the same error)."""
        listing: Any = None
        if self.rank == 0:
            try:
                listing = self.storage.listing()
            except OSError as e:
                listing = f"cannot list {self.storage.root}: {os_reason(e)}"
        listing = collective.broadcast(listing, self.group)
        if isinstance(listing, str):
            raise CheckpointError(listing, FIX_STORAGE)
        return listing

    def verify(self, name: str) -> integrity.Verdict:
        return collective.agreed_verdict(
            self.storage, name, self.policy.verify, self.site.ranks,
            round_bytes=self.verify_round_bytes, on_bytes=self._ticker.tick, key=self.key)

    def report_skipped(self, choice: layout.Choice) -> None:
        """Rank 0: set failed checkpoints aside; warn about newer incomplete ones."""
        if self.rank != 0:
            return
        for s in choice.failed:
            self.quarantine(s.name, s.reason, s.kind)
        for s in choice.incomplete:
            self.events.emit("warning", message=f"ignoring incomplete checkpoint {s.name} ({s.reason})")

    def quarantine(self, name: str, reason: str, kind: str, move_unsigned: bool = False) -> str | None:
        """Rank 0: move a checkpoint that cannot be used where nothing will load or count it
        (an unsigned one stays, unless ``move_unsigned``); its new name, or None."""
        return quarantine.set_aside(self.storage, name, reason, kind, events=self.events, now=self._clock(),
                                    blocked=self.tenure.superseded(), move_unsigned=move_unsigned)

    def ours(self, name: str) -> bool:
        """Rank 0: is ``name`` this job's (signed with its key)? True without a key (tests,
        benches: everything is trusted there)."""
        return self.key is None or integrity.signed_by(self.storage, name, self.key).ok
