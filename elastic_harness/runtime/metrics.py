"""Step and evaluation metrics, where users look: ``events.jsonl`` and TensorBoard.

Rank 0 writes both (every rank computes the same reduced numbers). TensorBoard files go to
``RUN_DIR/tensorboard`` through TensorBoard's own ``SummaryWriter``; a generation that resumed
from step S opens its writer with ``purge_step=S+1``, so the steps a crash made it redo are
shown once, not twice. The writer is created on first use, so a worker that never logs
never imports TensorBoard.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_harness import runfiles
from elastic_harness.deps import require_extra


@dataclass(frozen=True)
class StepFigures:
    """A step's figures: its mean loss, the world it ran on, the samples consumed so far, its
    seconds and global batch (for samples/s), the agent's restart count, the learning rate
    and the script's own metrics."""

    loss: float
    world_size: int
    samples: int
    step_s: float
    global_batch: int
    restart: int
    lr: float | None = None
    extra: dict[str, float] = field(default_factory=dict)


class Metrics:
    def __init__(self, events: Any, run_dir: Path, *, tensorboard: bool, main: bool) -> None:
        self.events, self.run_dir = events, run_dir
        self.tensorboard, self.main = tensorboard, main
        if tensorboard and main:
            require_extra("tensorboard")  # at init, not at the first logged step
        self._writer: Any = None
        self._purge_step: int | None = None

    def resumed_at(self, step: int) -> None:
        """Steps after ``step`` are redone by this generation (hide earlier copies of them)."""
        self._purge_step = step + 1

    def step(self, step: int, figures: StepFigures) -> None:
        if not self.main:
            return
        f = figures
        samples_per_s = round(f.global_batch / f.step_s, 2) if f.step_s > 0 else None
        self.events.emit("step", step=step, loss=round(f.loss, 6), world_size=f.world_size,
                         samples=f.samples, restart=f.restart, step_s=round(f.step_s, 5),
                         samples_per_s=samples_per_s, lr=f.lr,
                         metrics={k: round(v, 6) for k, v in f.extra.items()} or None)
        scalars = {"train/loss": f.loss, "train/samples_per_s": samples_per_s,
                   "train/world_size": f.world_size, **{f"train/{k}": v for k, v in f.extra.items()}}
        if f.lr is not None:
            scalars["train/lr"] = f.lr
        self._scalars(step, scalars)

    def evaluation(self, step: int, metrics: dict[str, float], seconds: float) -> None:
        if not self.main:
            return
        self.events.emit("eval", step=step, metrics={k: round(v, 6) for k, v in metrics.items()},
                         eval_s=round(seconds, 4))
        self._scalars(step, {f"eval/{k}": v for k, v in metrics.items()})

    def _scalars(self, step: int, values: dict[str, float | None]) -> None:
        if not self.tensorboard:
            return
        writer = self._open()
        for tag, value in values.items():
            if value is not None:
                writer.add_scalar(tag, value, global_step=step)

    def _open(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.run_dir / runfiles.TENSORBOARD),
                                         purge_step=self._purge_step, flush_secs=10)
        return self._writer

    def close(self) -> None:
        """Flush and close the TensorBoard writer (safe to call twice)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
