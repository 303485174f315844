"""Learning rate as a pure function of the step: nothing to checkpoint, any world size."""

from __future__ import annotations

import math

from elastic_harness.spec import OptimizerSpec


def lr_at(step: int, opt: OptimizerSpec, total_steps: int) -> float:
    """LR for the update that produces step ``step + 1`` (``step`` = updates done so far)."""
    if opt.warmup_steps and step < opt.warmup_steps:
        return opt.lr * (step + 1) / opt.warmup_steps
    if opt.schedule == "constant":
        return opt.lr
    span = max(1, total_steps - opt.warmup_steps)
    progress = min(1.0, (step - opt.warmup_steps) / span)
    floor = opt.lr * opt.min_lr_ratio
    return floor + (opt.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
