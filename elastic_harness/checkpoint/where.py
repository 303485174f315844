"""Where a run's checkpoints live: one pure answer for every caller.

The worker, ``ckpt``, ``report``/``verify``, ``offline`` and ``rundir`` (``--fresh``, locks)
all ask the same question; they all call ``checkpoint_root``. Nothing here touches storage
or reads the current directory.

Rules: an empty ``checkpoint.dir`` means ``RUN_DIR/checkpoints``; a URL (``s3://...``, any
fsspec scheme except ``file://``) is used as written, minus a trailing slash; ``file://PATH``
is the local ``PATH``; a relative local path is relative to the run directory (so every
process finds the same place whatever its working directory).
"""

from __future__ import annotations

import posixpath
from pathlib import PurePath

from elastic_harness import runfiles

DEFAULT_SUBDIR = runfiles.CHECKPOINTS


def is_url(target: str) -> bool:
    """True for object-store / fsspec URLs; ``file://`` and plain paths are local."""
    return "://" in target and not target.startswith("file://")


def local_path(target: str) -> str:
    """A local target without its ``file://`` prefix."""
    return target.removeprefix("file://")


def checkpoint_root(checkpoint_dir: str, run_dir: str | PurePath) -> str:
    """The checkpoint root of a run: ``checkpoint.dir`` resolved against ``run_dir``."""
    if not checkpoint_dir:
        return posixpath.join(str(run_dir), DEFAULT_SUBDIR)
    if is_url(checkpoint_dir):
        return checkpoint_dir.rstrip("/")
    path = local_path(checkpoint_dir)
    return posixpath.normpath(posixpath.join(str(run_dir), path))


def inside(root: str, run_dir: str | PurePath) -> bool:
    """Is the (local) checkpoint root within the run directory? URLs never are."""
    if is_url(root):
        return False
    run = posixpath.normpath(str(run_dir))
    return posixpath.commonpath([posixpath.normpath(root), run]) == run
