"""Pure: a failed save or load, in one short line for the terminal and the ``failure`` event.

DCP raises ``CheckpointException``, whose ``repr`` holds every failed rank's whole stack
summary (hundreds of characters of ``FrameSummary``). What a user needs is each rank's own
exception: ``ranks 0,1: OSError: [Errno 28] No space left on device``. The full text goes to
the event's ``detail`` (the run's log).
"""

from __future__ import annotations

from torch.distributed.checkpoint.api import CheckpointException

MAX_LINE = 300
MAX_DETAIL = 4000
# torch's file writer (inline_container.cc) reports a short write as a position mismatch,
# not as the OSError behind it: on a full disk, one rank says ENOSPC and another this.
SHORT_WRITE = "unexpected pos"
FULL_BELOW = 1 << 20  # bytes left: a disk this close to full is what cut the write short
ENOSPC_LINE = "OSError: [Errno 28] No space left on device"


def one_line(err: BaseException, free_bytes: int | None = None) -> str:
    """Each distinct cause once, with the ranks it hit (a ``CheckpointException``), or the
    exception's type and first line. ``free_bytes``: what the storage has left, where it can
    tell; a short write with (almost) nothing left is named as the full disk it is."""
    failures = getattr(err, "failures", None) if isinstance(err, CheckpointException) else None
    if not isinstance(failures, dict) or not failures:
        return _named(_exception_line(err), free_bytes)
    ranks_of: dict[str, list[str]] = {}
    for rank, wrapped in sorted(failures.items(), key=lambda kv: str(kv[0])):
        cause = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped
        text = _named(_exception_line(cause) if isinstance(cause, BaseException) else str(cause), free_bytes)
        ranks_of.setdefault(text, []).append(str(rank))
    parts = [f"rank{'s' if len(r) > 1 else ''} {','.join(r)}: {text}" for text, r in ranks_of.items()]
    return "; ".join(parts)[:MAX_LINE]


def detail(err: BaseException) -> str:
    """The full text (DCP's includes each rank's traceback), bounded."""
    return str(err)[:MAX_DETAIL] if str(err) else repr(err)[:MAX_DETAIL]


def _named(text: str, free_bytes: int | None) -> str:
    full = free_bytes is not None and free_bytes < FULL_BELOW
    return ENOSPC_LINE if full and SHORT_WRITE in text else text


def _exception_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    text = lines[0].strip() if lines else ""
    return (f"{type(e).__name__}: {text}" if text else type(e).__name__)[:MAX_LINE]
