"""Pure: a run dir's events -> ``summary.json`` (the current invocation, read by ``runstate``).

Counts (steps, restarts, checkpoints) are of the current invocation; ``goodput`` is the
whole run dir's, the same figure ``elastic-harness report`` prints.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from elastic_harness.records.runstate import current_invocation, fold

__all__ = ["current_invocation", "summarize"]


def summarize(events: Sequence[dict]) -> dict:
    s = fold(current_invocation(events))
    return {
        "finished": s.finished,
        "steps": s.step,
        "final_loss": s.loss,
        "first_loss": s.first_loss,
        "restarts": s.restarts,
        "world_sizes": s.world_sizes,
        "samples_consumed": s.samples,
        "resumed_from_step": s.resumed_from_step,
        "checkpoints_written": s.checkpoints,
        "last_checkpoint": s.last_checkpoint,
        "failures": s.failures,
        "faults": s.faults,
        "wall_s": round((s.last_t or 0.0) - (s.first_t or 0.0), 3),
        "goodput": dataclasses.asdict(fold(events).goodput()),
        "model_digest": s.digest,
    }
