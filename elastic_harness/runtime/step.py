"""One optimizer step of a user's loop: its micro-batches, the loss scaling, the step hook.

A ``Step`` is what ``Run.steps()`` yields. Call order inside the loop body::

    for step in run.steps(dataset):
        for batch in step.batches():          # this rank's micro-batches, on run.device
            with run.autocast():
                loss = loss_fn(model(batch))  # a mean over the micro-batch, or per-sample
            step.backward(loss)               # instead of loss.backward()
        optimizer.step()                      # or step.optimizer_step(optimizer)
        optimizer.zero_grad()
        step.done()                           # the step hook: always last

``batches()`` turns gradient synchronisation off for every micro-batch but the last (DDP's
``require_backward_grad_sync``, FSDP2's ``set_requires_gradient_sync``), so ranks
accumulate locally and all-reduce once per step. ``backward`` scales the loss so the update
is the mean over exactly the global batch whatever the world size (see ``scale``), and goes
through the GradScaler under fp16. ``done`` hands the step to the step hook
(``runtime.hook``): counters, metrics, checkpoint, drain, faults.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import nn

from elastic_harness.errors import UsageError
from elastic_harness.spec import JobSpec
from elastic_harness.torchcompat.nn import unwrap_compiled


class Owner(Protocol):
    """What a step needs of its run: the step hook (``runtime.hook.StepHook``)."""

    spec: JobSpec
    dp_size: int  # the data-parallel degree: how many ranks average the gradients
    model: nn.Module | None
    optimizer: torch.optim.Optimizer | None
    scaler: Any

    def start_vote(self, step: Step) -> None: ...

    def after_backward(self) -> None: ...

    def begin_batches(self, step: Step) -> None: ...

    def end_batches(self, reduce: bool = True) -> None: ...

    def finish_in_flight(self, step: Step) -> Any: ...

    def after_step(self, step: Step, metrics: dict[str, float]) -> None: ...


def _fire_during_backward(grad: torch.Tensor) -> torch.Tensor:
    """A tensor hook on the last micro-batch's loss: fires a chaos fault armed for this step's
    backward (``runtime.faults``), once the backward pass has begun."""
    from elastic_harness.runtime.faults import fire_armed

    fire_armed("backward")
    return grad


def set_grad_sync(model: nn.Module, enabled: bool) -> None:
    """Let the next backward all-reduce gradients (or only accumulate them locally)."""
    model = unwrap_compiled(model)  # torch.compile's wrapper
    if hasattr(model, "require_backward_grad_sync"):  # DDP (what no_sync() toggles)
        model.require_backward_grad_sync = enabled
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)


class Step:
    def __init__(self, hook: Owner, number: int, plan: list, batches: list) -> None:
        self.hook = hook
        self.number = number  # this step's number once done (1 = the first update)
        self.plan = plan
        self._batches = batches
        self.lr: float | None = None  # the LR this update uses (read at the first scale(), before it steps)
        self.loss_sum = torch.zeros((), dtype=torch.float64)
        self.samples = 0
        self.backwards = 0
        self.finished = False
        self.drained = False
        self.thrown = False  # its generation broke: nothing of it was counted (``runtime.inplace``)
        self.reformed = False  # finished in place, in a generation re-formed under it (``runtime.inflight``)
        self.shared: Any = None  # the step's vote all-reduce, once launched (``StepHook.start_vote``)
        # what ends a step finished after a re-run of the training function, once its (extra)
        # micro-batches are done (``runtime.repoint``: the kept gradients of the lost replicas' step)
        self.completing: Any = None

    @property
    def is_last(self) -> bool:
        return self.number == self.hook.spec.train.steps

    @property
    def eval_due(self) -> bool:
        """Evaluation is due after this step (``eval.every_steps``; always after the last)."""
        every = self.hook.spec.eval.every_steps
        return bool(every) and not self.drained and (self.number % every == 0 or self.is_last)

    def batches(self) -> Iterator[Any]:
        """This rank's micro-batches, in order; gradient sync only on the last one.

        When the loop over them ends (every micro-batch's backward done, the ranks just
        met in the last gradient all-reduce), the step's own all-reduce (its vote:
        ``runtime.vote``) starts without waiting: it completes while the optimizer steps,
        and ``done`` collects it. A loop left early (``break``, an exception) does not
        start it; ``done`` then runs it itself.
        """
        model = self.hook.model
        last = len(self._batches) - 1
        self.hook.begin_batches(self)
        try:
            for i, batch in enumerate(self._batches):
                self._current, self._current_index = len(self.plan[i]), i
                if model is not None:
                    set_grad_sync(model, i == last)
                yield batch
            self.hook.end_batches()  # HSDP: the replica all-reduce, deferred to here (``runtime.inflight``)
            if self.completing is not None:
                self.completing()
            yield from self._finish_in_flight(model)
        finally:
            self.hook.end_batches(reduce=False)
            if model is not None:
                set_grad_sync(model, True)
        if not self.thrown:
            # A thrown step re-formed under it already: its vote would be launched on the next
            # generation, where only the members thrown with it meet it (a node's kept worker,
            # broken mid-step, beside a survivor that parked for its join at a step's end: gloo
            # aborted the worker on the size mismatch).
            self.hook.start_vote(self)

    def _finish_in_flight(self, model: nn.Module | None) -> Iterator[Any]:
        """The generation broke under this step and the survivors finish it in place
        (``runtime.inflight``): this rank's part of the lost share, as more micro-batches
        (gradients kept local), then the reduction at the new membership. The loss keeps the
        step's own scale; the step then counts in the new generation (``hook`` is its)."""
        finish = self.hook.finish_in_flight(self)
        if finish is None:
            return
        for chunk, batch in zip(finish.plan, finish.batches, strict=True):
            self._current = len(chunk)
            if model is not None:
                set_grad_sync(model, False)
            yield batch
        self.hook = finish.done(self)
        self.reformed = True

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to differentiate: the micro-batch's share of the global-batch mean.

        ``loss`` is the mean over the current micro-batch (a 0-dim tensor, what
        ``reduction='mean'`` gives), or one value per sample (shape ``[B]``). DDP and FSDP
        average gradients over the data-parallel ranks, so the micro-batch's sum is scaled by
        ``dp_size / global_batch`` (``runtime.topology``: the data-parallel degree, the world
        size under ``ddp``/``fsdp``). Also counts the loss for the step's reported mean.
        """
        n = getattr(self, "_current", None)
        if n is None:
            raise UsageError("step.scale/backward called outside step.batches()",
                             "compute the loss inside `for batch in step.batches():`")
        if self.samples == 0 and self.hook.optimizer is not None:
            self.lr = self.hook.optimizer.param_groups[0].get("lr")  # the LR this update uses
        total = loss.sum() if loss.ndim else loss * n
        self.loss_sum += total.detach().double().sum().cpu()
        self.samples += n
        return total * (self.hook.dp_size / self.hook.spec.train.global_batch_size)

    def backward(self, loss: torch.Tensor) -> None:
        """``scale(loss).backward()``, through the GradScaler under fp16."""
        scaled = self.scale(loss)
        scaler = self.hook.scaler
        if self._current_is_last():
            scaled.register_hook(_fire_during_backward)  # a chaos fault keyed to this backward, if armed
        (scaler.scale(scaled) if scaler is not None else scaled).backward()
        self.backwards += 1
        self.hook.after_backward()

    def _current_is_last(self) -> bool:
        return getattr(self, "_current_index", -1) == len(self._batches) - 1

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()``, or the GradScaler's step and update under fp16."""
        scaler = self.hook.scaler
        if scaler is None:
            optimizer.step()
            return
        scaler.step(optimizer)
        scaler.update()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Before clipping under fp16: bring gradients back to their true scale."""
        if self.hook.scaler is not None:
            self.hook.scaler.unscale_(optimizer)

    def done(self, **metrics: float) -> None:
        """The step hook, after the optimizer step: every rank, every step, exactly once.

        ``metrics`` (e.g. ``grad_norm=...``) are logged with the step; keep the same names
        on every rank (rank 0's values are the ones written).
        """
        if self.finished:
            raise UsageError(f"step.done() called twice for step {self.number}",
                             "call it once, at the end of the loop body")
        if self.backwards == 0:
            raise UsageError(
                f"step {self.number} ended without step.backward(loss)",
                "use step.backward(loss) instead of loss.backward(): it scales the loss for "
                "the fixed global batch and counts it",
            )
        self.finished = True
        self.hook.after_step(self, {k: float(v) for k, v in metrics.items()})

