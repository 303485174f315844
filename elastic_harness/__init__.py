"""elastic_harness: fault-tolerant elastic training for PyTorch (torchelastic + DCP).

For your own training script::

    import elastic_harness as eh

    run = eh.init("jobs/my_job.yaml")
    ...
    run.register(model, optimizer, scheduler=scheduler)
    for step in run.steps(dataset):
        for batch in step.batches():
            step.backward(loss_of(batch))
        optimizer.step(); optimizer.zero_grad()
        step.done()

See ``elastic_harness.runtime.session`` for the whole contract. Importing this package is
cheap: torch is imported when ``init`` is first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from elastic_harness.errors import HarnessError, UsageError

__version__ = "0.2.0"
__all__ = ["HarnessError", "Run", "Step", "UsageError", "init"]

if TYPE_CHECKING:
    from elastic_harness.runtime.session import Run
    from elastic_harness.runtime.step import Step


def init(*args: Any, **kwargs: Any) -> Run:
    """Start this process's part of the job; see ``elastic_harness.runtime.session.init``."""
    from elastic_harness.runtime.session import init as _init

    return _init(*args, **kwargs)


def __getattr__(name: str) -> Any:
    if name == "Run":
        from elastic_harness.runtime.session import Run

        return Run
    if name == "Step":
        from elastic_harness.runtime.step import Step

        return Step
    raise AttributeError(f"module 'elastic_harness' has no attribute {name!r}")
