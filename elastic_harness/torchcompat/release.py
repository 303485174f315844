"""Which torch releases the harness runs on (pure: no torch import, so the host can refuse a
release before paying for importing it).

``RANGE`` is pyproject.toml's torch requirement (a test keeps the two equal): the releases
``.ci/compat`` proved, from the oldest to the newest, each with the fast tier and the
end-to-end set green on CPU (docs/torch-versions.md). A release below it is refused; one
above it (a newer torch than any proven, e.g. a nightly) runs when every probe of
``torchcompat.probe`` passes, with one warning line.
"""

from __future__ import annotations

import re

LOWEST = (2, 11)  # the oldest release proven (inclusive)
ABOVE = (2, 16)  # the first release not proven (exclusive)
RANGE = f">={LOWEST[0]}.{LOWEST[1]},<{ABOVE[0]}.{ABOVE[1]}"
PROVEN = ("2.11.0", "2.13.0", "2.14.1", "2.15.0")  # each ran .ci/compat green (2.13.0: the main tier)

OLDER, SUPPORTED, NEWER = "older", "supported", "newer"


def release(version: str) -> tuple[int, int, int]:
    """``2.13.0+cpu`` -> (2, 13, 0); ``2.16.0.dev20260301`` -> (2, 16, 0); ``2.11.0a0+git`` ->
    (2, 11, 0). The local tag (CPU or CUDA build) and pre-release marks say nothing about the
    API. ValueError for something that is not a version."""
    m = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", version)
    if m is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def verdict(version: str) -> str:
    """Pure: OLDER (refused), SUPPORTED, or NEWER (runs if every probe passes)."""
    major_minor = release(version)[:2]
    if major_minor < LOWEST:
        return OLDER
    return NEWER if major_minor >= ABOVE else SUPPORTED


def older_message(version: str) -> tuple[str, str]:
    """(message, fix) for a release below the range."""
    return (f"torch {version} is older than elastic-harness supports (torch{RANGE})",
            f"pip install 'torch{RANGE}' (docs/torch-versions.md)")


def newer_warning(version: str, every_probe_passed: bool = True) -> str:
    how = ("every probe of its internals passed, so it runs" if every_probe_passed
           else "it runs without the features named below")
    return (f"torch {version} is newer than the releases elastic-harness was proven on (torch{RANGE}); "
            f"{how} (docs/torch-versions.md)")
