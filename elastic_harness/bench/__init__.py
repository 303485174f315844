"""Benchmarks (``elastic-harness bench NAME``): each module exposes ``register(subparsers)``.

They run the harness's real code paths on this machine and print JSON with medians, ratios
and whether each goal was met; timings live here, never in tests. Their arguments are
checked before anything is measured (``scratch_dir``, ``check_out``): a bad ``--dir`` or
``--out`` must not cost a long run and then a traceback.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from elastic_harness.errors import HarnessError


def scratch_dir(prefix: str, parent: str | None) -> Path:
    """A fresh directory under ``parent`` (``--dir``; default the system temp dir) that the
    caller removes when done."""
    try:
        return Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    except OSError as e:
        where = parent or tempfile.gettempdir()
        raise HarnessError(f"cannot make a scratch directory in '{where}': {e.strerror}",
                           "pass --dir an existing directory you can write") from None


@contextlib.contextmanager
def spawning_into(scratch: Path) -> Iterator[None]:
    """While a bench spawns its own rank processes: what torch would leave in the temp dir
    goes into ``scratch`` (removed by the caller) instead. Their compile cache
    (``launch.scratch.torch_environ``), and the traceback file ``torch.multiprocessing``
    names per child in the temp dir and never removes when a child failed."""
    from elastic_harness.launch.scratch import torch_environ

    added = torch_environ(scratch, os.environ)
    os.environ.update(added)
    saved, tempfile.tempdir = tempfile.tempdir, str(scratch)
    try:
        yield
    finally:
        tempfile.tempdir = saved
        for key in added:
            os.environ.pop(key, None)


def check_out(path: str | None) -> None:
    """``--out FILE`` must be writable before the bench runs, not after."""
    if path is None:
        return
    parent = Path(path).resolve().parent
    if Path(path).is_dir() or not parent.is_dir() or not os.access(parent, os.W_OK):
        raise HarnessError(f"--out '{path}' cannot be written",
                           "name a file in an existing directory you can write")
