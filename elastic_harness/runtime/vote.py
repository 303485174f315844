"""The step's one all-reduce: what each rank says about the step, summed over the ranks and
read back by name (as torchft's ``should_commit`` reduces every rank's verdict on a step).

Every rank packs its own ``StepVote`` (``pack``); the sum over the ranks, unpacked here
(``unpack``), is the job's: a flag any rank raised is raised; a value only rank 0 gives
(its clock and timings decide) arrives as rank 0's. A field is one float of the tensor, in
the order of the fields: adding one is one line here.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields

import torch


@dataclass(frozen=True)
class StepVote:
    loss_sum: float = 0.0  # every rank: the loss of its micro-batches, summed
    drain: bool = False  # some rank was asked to drain (a stop, or a node joining)
    save_due: bool = False  # rank 0: the time-based save is due (``checkpoint.every_seconds``)
    snapshot_every: int = 0  # rank 0: the in-memory snapshot interval it proposes (``memtier.cadence``)
    copies_busy: bool = False  # buddy copies moving somewhere, or (rank 0) not due yet (``buddy.due``)
    stop: bool = False  # some rank was asked to stop, not only to make room for a joining node
    copies_moving: bool = False  # buddy copies moving somewhere (not merely held back)

    def pack(self) -> torch.Tensor:
        """This rank's say, as the tensor the ranks all-reduce (sum)."""
        return torch.tensor([float(v) for v in astuple(self)], dtype=torch.float64)

    @classmethod
    def unpack(cls, totals: torch.Tensor) -> StepVote:
        """The job's vote from the summed tensor."""
        return cls(*(type(f.default)(v) for f, v in zip(fields(cls), totals.tolist(), strict=True)))
