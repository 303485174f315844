"""DCP: the one private location the harness still reaches, DCP's fsspec reader and writer.

Everything else DCP-side is public: plan caching is a ``DefaultSavePlanner`` subclass with
its own cache (``checkpoint.plans``), staging for async saves is a public ``AsyncStager``
(``checkpoint.staging``), flattening is the default planner's (``plans.flatten``), and loading
a pickled item sets it with our own walk (``checkpoint.safe_load``).

``FsspecWriter``/``FsspecReader`` are public in ``torch.distributed.checkpoint`` from torch
2.15; before, they live in the private ``_fsspec_filesystem`` module. Feature
``fsspec-storage`` (off: ``checkpoint.dir`` as a URL, s3:// included, is refused). The probe
looks for the module's file, without importing DCP (over a second on these machines).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from elastic_harness.torchcompat.probe import feature, on

_PRIVATE = "torch.distributed.checkpoint._fsspec_filesystem"


def _dcp_dir() -> Path | None:
    spec = importlib.util.find_spec("torch")
    return Path(spec.origin).parent / "distributed" / "checkpoint" if spec and spec.origin else None


@feature("fsspec-storage", "checkpoints at a URL",
         "checkpoint.dir must be a local path (s3:// and other fsspec URLs are refused)")
def _fsspec() -> list[str]:
    where = _dcp_dir()
    if where is not None and ((where / "_fsspec_filesystem.py").is_file() or (where / "fsspec_filesystem.py").is_file()):
        return []
    return ["torch.distributed.checkpoint.FsspecWriter/FsspecReader"]


def fsspec_classes() -> tuple[Any, Any]:
    """(FsspecWriter, FsspecReader): the public names where this torch has them. Raises
    ``ModuleNotFoundError`` (the caller's one line) where ``fsspec-storage`` is off."""
    import torch.distributed.checkpoint as dcp

    if hasattr(dcp, "FsspecWriter") and hasattr(dcp, "FsspecReader"):
        return dcp.FsspecWriter, dcp.FsspecReader
    if not on("fsspec-storage"):
        raise ModuleNotFoundError("this torch's DCP has no FsspecWriter/FsspecReader")
    module = importlib.import_module(_PRIVATE)
    return module.FsspecWriter, module.FsspecReader
