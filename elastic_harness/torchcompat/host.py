"""Before anything is launched: can the installed torch run the harness?

``check_release`` reads the installed release from the package metadata (no torch import)
and refuses one older than ``release.RANGE``. ``check_host`` then imports torch: a build
without ``torch.distributed``, or one that lacks a private name a *required* feature needs
(``probe``), is refused; each optional feature it lacks is a warning line, and a release
newer than the range that passes every probe gets one warning line. Each refusal is one
``TorchUnsupported`` line, exit 2, raised before any agent, worker or checkpoint is touched.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable
from typing import Any

from elastic_harness.errors import HarnessError
from elastic_harness.torchcompat import probe, release

FIX = f"pip install 'torch{release.RANGE}' (docs/torch-versions.md)"


class TorchUnsupported(HarnessError):
    """The installed torch cannot run the harness (release, build, or a missing internal)."""


def installed_version() -> str | None:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_release(version: str | None = None) -> str:
    """The installed release, refused (``TorchUnsupported``) when below the range or absent."""
    version = installed_version() if version is None else version
    if version is None:
        raise TorchUnsupported("torch is not installed", FIX)
    try:
        verdict = release.verdict(version)
    except ValueError:
        return version  # a local build with an odd version string: the probes decide
    if verdict == release.OLDER:
        raise TorchUnsupported(*release.older_message(version))
    return version


def needs(spec: Any) -> tuple[str, ...]:
    """Pure: features this job cannot run without, besides the required ones (the spec is
    taken duck-typed): a checkpoint directory at a URL needs DCP's fsspec classes."""
    return ("fsspec-storage",) if "://" in str(spec.checkpoint.dir) else ()


def check_host(version: str | None = None, need: tuple[str, ...] = ()) -> list[str]:
    """Everything ``check_release`` checks, then the build and every probe; returns the
    warning lines to print (features off, a newer release), raises for a refusal: the build
    has no ``torch.distributed``, or a required feature (or one in ``need``) is off."""
    version = check_release(version)
    import torch.distributed

    if not torch.distributed.is_available():
        raise TorchUnsupported(f"torch {torch.__version__} was built without torch.distributed, which "
                               "elastic-harness needs", "install a build of torch with distributed support: "
                               + FIX)
    lines = []
    for f in probe.all_features().values():
        gone = probe.missing(f.key)
        if gone and (f.required or f.key in need):
            raise TorchUnsupported(f"torch {torch.__version__} has no {', '.join(gone)}, which elastic-harness's "
                                   f"{f.title} needs (proven on torch{release.RANGE})", FIX)
        if gone:
            lines.append(probe.off_line(f, gone))
            probe.mark_said(f.key)
    if _verdict(version) == release.NEWER:
        lines.insert(0, release.newer_warning(str(torch.__version__), every_probe_passed=not lines))
    return lines


def _verdict(version: str) -> str:
    try:
        return release.verdict(version)
    except ValueError:
        return release.SUPPORTED


def check_and_warn(spec: Any = None, say: Callable[[str], None] | None = None) -> None:
    """``check_host`` for ``spec``'s needs, each warning line said once (``say``: default
    ``warning: LINE`` on stderr)."""
    for line in check_host(need=needs(spec) if spec is not None else ()):
        (say or _warn)(line)


def _warn(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr, flush=True)
