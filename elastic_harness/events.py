"""The run's event log: one JSON object per line in ``RUN_DIR/events.jsonl``.

Several processes append to the same file (the host CLI, each agent, rank 0 of each
worker generation). Each event is one ``write()`` of one line on a file opened with
``O_APPEND``, which POSIX makes atomic for local files, so lines never interleave.

Every event has ``t`` (unix seconds), ``event`` (its kind) and ``pid``. Kinds and their
fields:

- ``start``: host or agent started (``who``, ``nodes``, ``nproc_per_node``, ``run_id``).
- ``rendezvous``: a worker generation formed (``world_size``, ``restart``, ``rdzv_s``).
- ``resume``: state restored (``step``, ``saved_world_size``, ``world_size``, ``load_s``)
  or ``fresh: true`` when no checkpoint was found.
- ``step``: ``step``, ``loss``, ``world_size``, ``samples`` (consumed so far), ``restart``,
  ``step_s``, ``samples_per_s``.
- ``checkpoint``: ``step``, ``path``, ``blocking_s``, ``total_s``, ``async``.
- ``warning``: ``message`` (e.g. an incomplete checkpoint skipped).
- ``failure``: ``message`` (and ``rank`` where known).
- ``fault``: a chaos fault fired (``kind``, ``target``, ``step``).
- ``finish``: ``step``, ``loss``, ``digest`` (sha256 of the final parameters).
- ``exit``: host or agent exit (``who``, ``code``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


class EventLog:
    """Appends events to one file. Safe to share between processes (see module doc)."""

    def __init__(self, path: str | Path, clock=time.time) -> None:
        self.path = Path(path)
        self._clock = clock

    def emit(self, event: str, **fields: Any) -> dict:
        record = {"t": round(self._clock(), 6), "event": event, "pid": os.getpid(), **fields}
        line = (json.dumps(record, sort_keys=False, default=str) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        return record


def read_events(path: str | Path) -> list[dict]:
    """All complete events; a torn last line (writer killed mid-write) is skipped."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
