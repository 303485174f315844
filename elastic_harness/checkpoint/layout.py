"""Pure checkpoint layout: names, completeness, what to load, what to purge.

A checkpoint is a directory ``step-NNNNNNN`` under the checkpoint root. DCP writes its
``.metadata`` file last, after every rank's shards, so a step directory is *complete* only
when ``.metadata`` exists; when a manifest is required (integrity on), it must exist too,
since the manifest is written after ``.metadata`` at commit. Nothing here touches storage:
callers pass in listings and get decisions back.

A checkpoint that failed verification or loading is *set aside* under a name ``scan``
never matches (``step-NNNNNNN.bad-STAMP``): it is never loaded, never counted for
retention, and a new save of that step can go ahead.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

STEP_RE = re.compile(r"^step-(\d{7,})$")
QUARANTINED_RE = re.compile(r"^step-(\d{7,})\.bad-[0-9A-Za-z-]+$")
METADATA = ".metadata"
MANIFEST = "manifest.json"
INFO = "harness.json"


def step_dirname(step: int) -> str:
    assert step >= 0
    return f"step-{step:07d}"


def parse_step(name: str) -> int | None:
    m = STEP_RE.match(name)
    return int(m.group(1)) if m else None


def quarantine_name(name: str, stamp: str) -> str:
    """Where a failed checkpoint ``name`` is set aside; ``stamp`` keeps names unique."""
    assert STEP_RE.match(name), name
    return f"{name}.bad-{stamp}"


def parse_quarantined(name: str) -> int | None:
    m = QUARANTINED_RE.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class StepDir:
    step: int
    name: str
    complete: bool


def scan(listing: Mapping[str, Iterable[str]], require_manifest: bool = False) -> list[StepDir]:
    """Step directories, oldest first, from ``{dirname: filenames}``.

    Names that are not step directories (temp files, quarantined checkpoints) are ignored.
    """
    out = []
    for name, files in listing.items():
        step = parse_step(name)
        if step is None:
            continue
        files = set(files)
        complete = METADATA in files and (MANIFEST in files or not require_manifest)
        out.append(StepDir(step, name, complete))
    return sorted(out, key=lambda d: d.step)


def load_candidates(dirs: list[StepDir]) -> list[StepDir]:
    """Complete checkpoints, newest first: try them in this order until one verifies."""
    return [d for d in reversed(dirs) if d.complete]


def to_purge(
    dirs: list[StepDir],
    keep: int,
    keep_every: int = 0,
    protected: Iterable[int] = (),
    foreign: Iterable[str] = (),
) -> list[StepDir]:
    """Complete checkpoints beyond the newest ``keep``, oldest first.

    Never purged: incomplete directories (a save may be writing them; the purger removes
    stale ones, ``purger.stale_incomplete``), milestones (``step % keep_every == 0``), ``protected`` steps (being
    loaded or written), and ``foreign`` ones (names of checkpoints that are not this job's:
    unsigned or forged), which are not counted either: a planted directory takes no place
    of the job's own.
    """
    assert keep >= 2, "the spec guarantees keep >= 2"
    protected, foreign = set(protected), set(foreign)
    complete = [d for d in dirs if d.complete and d.name not in foreign]
    older = complete[:-keep] if len(complete) > keep else []
    return [
        d
        for d in older
        if d.step not in protected and not (keep_every and d.step % keep_every == 0)
    ]


class _Verdict(Protocol):
    ok: bool
    reason: str
    kind: str


@dataclass(frozen=True)
class Skipped:
    name: str
    step: int
    reason: str
    kind: str  # "incomplete", or the failed verdict's kind ("corrupt", "unreadable", ...)


@dataclass(frozen=True)
class Choice:
    chosen: StepDir | None
    failed: tuple[Skipped, ...]  # complete ones that did not verify, newest first
    incomplete: tuple[Skipped, ...]  # incomplete ones newer than the choice
    complete: int  # complete checkpoints seen, failed ones included


def choose(
    listing: Mapping[str, Iterable[str]],
    verify: Callable[[str], _Verdict],
    *,
    require_manifest: bool = True,
    exclude: Iterable[str] = (),
) -> Choice:
    """The newest complete checkpoint that verifies, and what was passed over on the way.

    ``verify(name)`` is called newest first until one passes (it may be a collective: every
    rank calls ``choose`` with the same listing and gets the same answers). Names in
    ``exclude`` are passed over unverified (already found unusable by the caller).
    """
    dirs = scan(listing, require_manifest)
    exclude = set(exclude)
    chosen, failed = None, []
    candidates = load_candidates(dirs)
    for cand in candidates:
        if cand.name in exclude:
            continue
        verdict = verify(cand.name)
        if verdict.ok:
            chosen = cand
            break
        failed.append(Skipped(cand.name, cand.step, verdict.reason, verdict.kind))
    floor = chosen.step if chosen is not None else -1
    incomplete = tuple(
        Skipped(d.name, d.step, "interrupted save: .metadata or manifest missing", "incomplete")
        for d in reversed(dirs) if not d.complete and d.step > floor
    )
    return Choice(chosen, tuple(failed), incomplete, len(candidates))
