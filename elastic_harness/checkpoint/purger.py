"""Retention: rank 0 removes old checkpoints and the leftovers of crashed saves after a commit.

Called by the saver (``manager.Saver``) right after a save committed, on rank 0, in the
commit thread. Which complete checkpoints go is ``layout.to_purge``'s decision (the newest
``checkpoint.keep`` stay, and steps that are multiples of ``keep_every``; one that is not this
job's is neither counted nor removed); incomplete ones older than the committed step are
leftovers (``stale_incomplete``). Never removed: the step just committed and every step in
the tenure's ``busy`` set (being loaded or written, ``site.Tenure``).
"""

from __future__ import annotations

from elastic_harness.checkpoint import layout
from elastic_harness.checkpoint.site import Site, Tenure
from elastic_harness.checkpoint.verifier import Verifier
from elastic_harness.spec import CheckpointSpec


def stale_incomplete(dirs: list[layout.StepDir], below: int) -> list[layout.StepDir]:
    """Incomplete step directories older than step ``below``: leftovers of interrupted saves.

    Only called right after step ``below`` committed, when no other save of this job is in
    flight, so none of these is being written.
    """
    return [d for d in dirs if not d.complete and d.step < below]


class Purger:
    def __init__(self, site: Site, tenure: Tenure, verifier: Verifier, policy: CheckpointSpec) -> None:
        self.tenure, self.verifier, self.policy = tenure, verifier, policy
        self.storage, self.events = site.storage, site.events

    def purge(self, committed: int) -> None:
        """Rank 0, right after ``committed``: retention, then leftovers of crashed saves.

        The fence is not read again: the commit read it moments ago. A generation that
        started since is still restoring, from the newest checkpoint, which is kept (keep >= 2),
        and has written nothing a leftover could be."""
        try:
            dirs = layout.scan(self.storage.listing(), require_manifest=True)
            protect = self.tenure.busy | {committed}
            foreign = {d.name for d in dirs if d.complete and not self.verifier.ours(d.name)}
            doomed = layout.to_purge(dirs, self.policy.keep, self.policy.keep_every, protect, foreign)
            for d in doomed + stale_incomplete(dirs, committed):
                if d.step not in protect:
                    self.storage.remove(d.name)
        except OSError as e:  # a purge that fails costs space, not correctness
            self.events.emit("warning", message=f"purging old checkpoints failed: {e!r:.300}")
