"""Where a run will resume, known on the host before anything starts, and what follows.

A job whose checkpoints already reach ``train.steps`` has nothing left to train, and a fault
keyed to a step at or before the resume point can never fire. ``run`` and ``submit`` say so
before anything starts (``check``), instead of starting agents that load the checkpoint,
train nothing and print an empty summary:

- finished, no faults asked for: one note (nothing trained; how to train more or start
  over), nothing started, exit 0;
- finished, with faults: refused (exit 2): none of them can fire, since nothing runs;
- not finished, a fault keyed to a step at or before the resume point: refused (exit 2),
  naming the faults, the step and the fixes (a later step, or ``--fresh``). The same rule
  as a fault keyed past ``train.steps`` (``chaos.vocabulary.check_targets``): a fault asked
  for must be one that can fire, or a chaos test passes without its fault.

The resume point is the checkpoint a new worker generation loads: a fresh ``run`` has an
empty memory tier, so it is the newest complete checkpoint that verifies
(``checkpoint.verify``) with the job's key, chosen as the workers choose it
(``layout.choose``; manifests, sizes or hashes are read, never a pickle). The listing alone
decides when it can (the newest complete step is below ``train.steps`` and every fault's
step); a checkpoint is verified only when the answer depends on it. Without the job's key
file nothing is decided here (the workers say what they find).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from elastic_harness import jobkey, runfiles
from elastic_harness.chaos.vocabulary import fault_text
from elastic_harness.checkpoint import integrity, layout
from elastic_harness.checkpoint.storage import open_storage
from elastic_harness.checkpoint.where import checkpoint_root
from elastic_harness.errors import HarnessError


@dataclass(frozen=True)
class Resume:
    step: int
    where: str  # the checkpoint's location, for messages


def check(spec, run_dir: Path, environ: Mapping[str, str] = os.environ) -> str:
    """"" when the run has work to do; the note to print when the job already finished
    (start nothing then). Raises ``HarnessError`` for faults that can never fire."""
    faults = pending(spec.chaos, run_dir)
    resumed = resume_point(spec, run_dir, environ, faults)
    if resumed is None:
        return ""
    finished, dead = judge(resumed.step, spec.train.steps, faults)
    if dead:
        raise _unreachable(spec, resumed, dead, finished)
    if not finished:
        return ""
    return (f"job '{spec.name}' already finished: its checkpoint {resumed.where} holds step {resumed.step} "
            f"of train.steps {spec.train.steps}; nothing was trained\n"
            f"  to train more, raise train.steps (e.g. --set train.steps={2 * spec.train.steps}: it resumes "
            f"from step {resumed.step}); to start over, add --fresh or pass another --run-dir")


def pending(faults: Sequence, run_dir: Path) -> list:
    """The faults of ``faults`` still to fire: a fault that fired in an earlier run of this
    directory (its marker, ``runfiles.fault_marker``) is done, not dead."""
    done = Path(run_dir) / runfiles.CHAOS
    return [f for i, f in enumerate(faults) if not (done / runfiles.fault_marker(i)).exists()]


def judge(resumed: int, total: int, faults: Sequence) -> tuple[bool, list]:
    """Pure: (the job already finished, the faults that can never fire) for a run resuming
    after step ``resumed`` of ``total``."""
    finished = resumed >= total
    dead = list(faults) if finished else [f for f in faults if 0 < f.at_step <= resumed]
    return finished, dead


def _unreachable(spec, resumed: Resume, dead: list, finished: bool) -> HarnessError:
    named = ", ".join(fault_text(f) for f in dead)
    which, them = (f"fault {named} cannot", "it") if len(dead) == 1 else (f"faults {named} cannot", "them")
    if finished:
        return HarnessError(f"job '{spec.name}' already finished at step {resumed.step} ({resumed.where}): "
                            f"nothing would train, so {which} fire",
                            f"start over to see {them} fire (--fresh, or another --run-dir), or raise "
                            f"train.steps and key {them} after step {resumed.step}")
    return HarnessError(f"{which} fire: this run resumes after step {resumed.step} ({resumed.where})",
                        f"key {them} after step {resumed.step} (e.g. @{resumed.step + 1}) or leave {them} out, "
                        "or start over (--fresh, or another --run-dir)")


def resume_point(spec, run_dir: Path, environ: Mapping[str, str] = os.environ,
                 faults: Sequence | None = None) -> Resume | None:
    """The checkpoint the run would resume from, when anything depends on it (module doc);
    None for a fresh start or when nothing does. ``faults``: those still to fire (default:
    the job's)."""
    key_file = jobkey.key_path(run_dir, environ)
    if not Path(run_dir).is_dir() or not key_file.is_file():
        return None
    try:
        storage = open_storage(checkpoint_root(spec.checkpoint.dir, Path(run_dir)))
        listing = storage.listing()
        candidates = layout.load_candidates(layout.scan(listing, True))
        steps = [f.at_step for f in (spec.chaos if faults is None else faults) if f.at_step]
        if not candidates or (candidates[0].step < spec.train.steps and all(s > candidates[0].step for s in steps)):
            return None
        key = jobkey.read(key_file)
        choice = layout.choose(listing, lambda name: integrity.verify(storage, name, spec.checkpoint.verify, key))
    except Exception:  # noqa: BLE001 - any storage failure (s3's own errors too): the workers
        return None  # meet the same storage and say what is wrong with it
    if choice.chosen is None:
        return None
    return Resume(choice.chosen.step, storage.uri(choice.chosen.name))
