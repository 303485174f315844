"""Every private torch name the harness reaches, grouped by the feature that needs it, each
probed once.

A ``Feature`` is registered by the module of this package that reaches its names
(``rdzv``, ``agent``, ``dcp``, ``nn``): a title, what happens without it (torch's own
behaviour), whether the harness can run at all without it, and a ``check`` that returns
the names this torch lacks (looked up, never called). ``on(key)`` probes once per process
and, when the feature is off, says so once (a logged warning); the code that uses the
feature then takes torch's own path. ``check_host`` runs every probe before anything is
launched (``run``, ``submit``, ``agent``): a required name missing is one line and exit 2.

Probing never raises: a check that fails in an unforeseen way counts as the feature off.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("elastic_harness.torchcompat")

Check = Callable[[], list[str]]


@dataclass(frozen=True)
class Feature:
    key: str
    title: str  # "rendezvous fast path"
    off: str  # what happens without it: torch's own behaviour
    check: Check  # the names this torch lacks (empty: the feature is on)
    required: bool = False  # without it the harness cannot run: the host refuses (exit 2)


FEATURES: dict[str, Feature] = {}
_missing: dict[str, tuple[str, ...]] = {}
_said: set[str] = set()

# The modules that register features (imported by ``all_features``); each imports torch.
MODULES = ("rdzv", "agent", "dcp", "nn", "groups")


def feature(key: str, title: str, off: str, *, required: bool = False) -> Callable[[Check], Check]:
    """Register the decorated check as feature ``key``."""
    def register(check: Check) -> Check:
        FEATURES[key] = Feature(key, title, off, check, required)
        return check
    return register


def missing(key: str) -> tuple[str, ...]:
    """The private names feature ``key`` needs that this torch lacks (probed once)."""
    if key not in _missing:
        try:
            found = tuple(FEATURES[key].check())
        except Exception as e:  # noqa: BLE001 - a probe must never end a run
            found = (f"(probe failed: {type(e).__name__}: {e})",)
        _missing[key] = found
    return _missing[key]


def on(key: str) -> bool:
    """Is feature ``key`` available on this torch? When not, say so once per process."""
    gone = missing(key)
    if gone and key not in _said:
        _said.add(key)
        log.warning("%s", off_line(FEATURES[key], gone))
    return not gone


def mark_said(key: str) -> None:
    """Feature ``key``'s off line was said elsewhere (``host``): ``on`` stays quiet."""
    _said.add(key)


def off_line(f: Feature, gone: tuple[str, ...]) -> str:
    return f"{f.title} off on torch {torch_version()}: {f.off} (this torch has no {', '.join(gone)})"


def torch_version() -> str:
    import torch

    return str(torch.__version__)


def all_features() -> dict[str, Feature]:
    for module in MODULES:
        importlib.import_module(f"elastic_harness.torchcompat.{module}")
    return FEATURES


def reset() -> None:
    """Forget every probe (tests that hide a name and probe again)."""
    _missing.clear()
    _said.clear()


# --- lookups for checks: each returns the names that are absent -----------------------------

def attrs(owner: Any, *names: str, label: str = "") -> list[str]:
    """Names ``owner`` (a module or class) does not have."""
    where = label or getattr(owner, "__name__", str(owner))
    return [f"{where}.{n}" for n in names if not hasattr(owner, n)]


def instance_attrs(cls: type, *names: str) -> list[str]:
    """Instance attributes that no torch class in ``cls``'s MRO sets or reads as
    ``self.NAME`` (they exist only on instances, so ``hasattr(cls)`` cannot tell). Reads the
    classes' source files as text (``inspect.getsource`` parses them: a second here)."""
    source = ""
    for path in {_source_file(k) for k in cls.__mro__ if k.__module__.startswith("torch")} - {None}:
        source += _read(path)
    return [f"{cls.__name__}.{n}" for n in names
            if not hasattr(cls, n) and not re.search(rf"self\.{re.escape(n)}\b", source)]


def _source_file(cls: type) -> str | None:
    try:
        return inspect.getsourcefile(cls)
    except TypeError:
        return None


@functools.cache
def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return ""


def parameters(fn: Callable, *names: str, label: str) -> list[str]:
    """Parameters ``fn`` does not take."""
    try:
        have = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return [f"{label}({n}=)" for n in names]
    return [f"{label}({n}=)" for n in names if n not in have]


def module(name: str) -> Any | None:
    """The module ``name``, or None if this torch has none."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
