"""What a task provides, and how the harness finds it.

A task is any object with three methods; ``task.target`` in the job YAML names a callable
(``package.module:callable``) that receives ``task.args`` as keyword arguments and returns
one. The harness calls them in this order, on every rank, on every (re)start:

1. ``build_model()`` once, right after the RNG is seeded with ``train.seed`` (so every rank
   and every restart builds the same initial weights). Build on CPU; the harness moves it.
2. ``dataset()`` once: a map-style dataset (``len`` and ``[i]``) whose items are tensors
   or tuples of tensors, or a sharded stream (``elastic_harness.data.Stream``, a Hugging
   Face streaming dataset...; docs/streaming.md). It must be the same on every rank and
   every restart.
3. ``loss(model, batch)`` per micro-batch: return one loss per sample (shape ``[B]``). The
   harness sums and scales them so the step's gradient is the mean over the global batch,
   whatever the world size. ``batch`` is the stacked items, already on the device.

Optional: ``collate(items) -> batch`` to replace the default stacking.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol, runtime_checkable

from elastic_harness.errors import TaskError


@runtime_checkable
class Task(Protocol):
    def build_model(self) -> Any: ...

    def dataset(self) -> Any: ...

    def loss(self, model: Any, batch: Any) -> Any: ...


def load_task(target: str, args: dict) -> Task:
    """Import ``package.module:callable`` and call it with ``args``."""
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise TaskError(
            f"task.target '{target}': cannot import module '{module_name}' ({e})",
            "check the module path and that it is importable (installed or on PYTHONPATH)",
        ) from e
    except Exception as e:  # noqa: BLE001 - a SyntaxError or an error raised at import time
        raise TaskError(
            f"task.target '{target}': importing module '{module_name}' failed: "
            f"{type(e).__name__}: {e}",
            f"fix the module (python -c 'import {module_name}' shows the traceback)",
        ) from e
    factory = getattr(module, attr, None)
    if factory is None:
        raise TaskError(
            f"task.target '{target}': module '{module_name}' has no attribute '{attr}'",
            "check the name after the colon",
        )
    try:
        task = factory(**args)
    except TypeError as e:
        raise TaskError(f"task.target '{target}' rejected task.args: {e}", "fix task.args") from e
    missing = [m for m in ("build_model", "dataset", "loss") if not callable(getattr(task, m, None))]
    if missing:
        raise TaskError(
            f"task.target '{target}' returned {type(task).__name__}, which lacks {missing}",
            "return an object with build_model(), dataset() and loss(model, batch)",
        )
    return task
