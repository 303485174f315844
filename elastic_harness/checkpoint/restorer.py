"""Loading: the newest complete checkpoint that verifies and loads, into the given state.

Every rank calls every method, in the same order (collectives on the checkpoint group).
``restore`` once per worker generation, first (it joins the generation, ``site.Tenure``), or
``join`` alone when the state came from elsewhere (the in-memory tier); ``newest_complete``
any time after. Which checkpoint to try is decided by ``layout.choose`` over rank 0's
listing, with the ``verifier``'s agreed verdicts; one that fails is set aside by the verifier
and the next older one is tried. A step being loaded is in the tenure's ``busy`` set: the
purger leaves it alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch.distributed.checkpoint as dcp

from elastic_harness.checkpoint import collective, integrity, layout
from elastic_harness.checkpoint.compat import check_compatible
from elastic_harness.checkpoint.failure_text import one_line
from elastic_harness.checkpoint.safe_load import WeightsOnlyLoadPlanner
from elastic_harness.checkpoint.site import SAVE_ERRORS, Site, Tenure
from elastic_harness.checkpoint.streams import Counter, watch_reader
from elastic_harness.checkpoint.verifier import Verifier
from elastic_harness.errors import CheckpointError


@dataclass(frozen=True)
class Loaded:
    step: int
    name: str
    manifest: dict
    seconds: float


class Restorer:
    def __init__(self, site: Site, tenure: Tenure, verifier: Verifier,
                 optional_keys: frozenset[str] = frozenset()) -> None:
        # ``optional_keys``: flattened state keys a checkpoint may lack (fields added later,
        # whose current value is what an older checkpoint meant: ``safe_load``).
        self.optional_keys = optional_keys
        self.tenure, self.verifier = tenure, verifier
        self.storage, self.info, self.group, self._ticker = site.storage, site.info, site.ranks.group, site.ticker

    def restore(self, state: dict[str, Any]) -> Loaded | None:
        """Load the newest complete, verified, loadable checkpoint into ``state``.

        Checkpoints that fail verification or loading are set aside (``quarantine`` event)
        and the next older one is tried; ``None`` when there is no complete checkpoint at
        all. Raises ``CheckpointError`` (on every rank) for a checkpoint of another model or
        job, when the ranks do not share the checkpoint directory, and when complete
        checkpoints existed but none is usable (``--fresh`` starts over on purpose).
        """
        self.join()
        unusable: set[str] = set()
        unloadable: list[tuple[str, str]] = []  # set aside only once an older one loads
        seen_complete = None
        unsigned = False
        while True:
            choice = layout.choose(self.verifier.shared_listing(), self.verifier.verify, exclude=unusable)
            seen_complete = choice.complete if seen_complete is None else seen_complete
            self.verifier.report_skipped(choice)
            unusable |= {s.name for s in choice.failed}
            unsigned = unsigned or any(s.kind == "unsigned" for s in choice.failed)
            if choice.chosen is None:
                self.verifier.report_unloadable(unloadable, set_aside=False)
                if seen_complete:
                    raise CheckpointError(
                        f"none of the {seen_complete} checkpoints in {self.storage.root} is usable "
                        "(see the quarantine and warning events)",
                        "an unsigned one (an older run's, another tool's, or planted) loads only once you have "
                        "reviewed it with 'elastic-harness ckpt trust RUN_DIR --step N'; or re-run with --fresh "
                        "to start over"
                        if unsigned else "restore a good copy, or re-run with --fresh to start over",
                    )
                return None
            loaded, why = self._load(choice.chosen, state)
            if loaded is not None:
                self.verifier.report_unloadable(unloadable, set_aside=True)
                return loaded
            unusable.add(choice.chosen.name)
            unloadable.append((choice.chosen.name, why))

    def newest_complete(self) -> int | None:
        """Collective: the step of the newest complete checkpoint listed (not verified), the
        same on every rank; None if none."""
        candidates = layout.load_candidates(layout.scan(self.verifier.shared_listing(), True))
        return candidates[0].step if candidates else None

    def join(self) -> None:
        """Every rank: the generation's first step in the checkpoint directory (``Tenure.join``,
        once). ``restore`` takes it; a generation restored from memory takes it alone."""
        self.tenure.join()

    def _load(self, choice: layout.StepDir, state: dict[str, Any]) -> tuple[Loaded | None, str]:
        """Every rank: load ``choice`` into ``state``; ``(None, why)`` on every rank if any failed.

        Compatibility is agreed first (a rank that cannot read ``.metadata`` says so instead
        of leaving), then DCP loads (its own collectives share errors between ranks).
        DCP reads into the tensors of ``state`` on whatever device they live (shards are
        deserialised on CPU first), so a checkpoint saved on GPUs loads on CPUs and back.
        """
        t0 = time.perf_counter()
        self.tenure.busy.add(choice.step)
        try:
            manifest = integrity.read_manifest(self.storage, choice.name) or {}
            mismatch, error = self._compatible(choice.name, state, manifest)
            agreed = collective.all_min(0 if mismatch else 1 if error else 2, self.group)
            if agreed == 0:
                raise mismatch or CheckpointError(
                    f"{self.storage.uri(choice.name)} does not match this job on another rank",
                    "see that rank's failure event; use a new --run-dir or --fresh for another model")
            if agreed == 2:
                try:
                    reader = watch_reader(self.storage.reader(choice.name), Counter(self._ticker.tick))
                    dcp.load(state, storage_reader=reader, process_group=self.group,
                             planner=WeightsOnlyLoadPlanner(self.optional_keys))
                except SAVE_ERRORS as e:  # a shard that fails to deserialise, unreadable files
                    error = e
            ok = collective.all_min(int(error is None and agreed == 2), self.group) == 1
        finally:
            self.tenure.busy.discard(choice.step)
        if ok:
            return Loaded(choice.step, choice.name, manifest, time.perf_counter() - t0), ""
        return None, one_line(error) if error is not None else "another rank failed to read it"

    def _compatible(self, name: str, state: dict, manifest: dict) -> tuple[CheckpointError | None, BaseException | None]:
        """(why ``name`` belongs to another model or job, why it could not be read)."""
        try:
            check_compatible(self.storage.reader(name), state, manifest, self.info)
        except CheckpointError as e:
            return e, None
        except SAVE_ERRORS as e:  # unreadable or garbled .metadata
            return None, e
        return None, None
