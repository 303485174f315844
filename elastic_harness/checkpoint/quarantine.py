"""Setting a checkpoint aside: rank 0 moves one that failed where nothing loads or counts it.

The new name (``layout.quarantine_name``: ``step-NNNNNNN.bad-STAMP``) is never scanned as a
step directory, so it is not loaded, not counted for retention, and a new save of that
step can go ahead. Nothing is deleted: ``ckpt ls`` lists these; the user removes them.
One ``quarantine`` event says what happened: ``step``, ``name``, ``reason``, ``kind``
(``corrupt``, ``unreadable``, ``unloadable``, ``forged``, ``unsigned``), ``moved_to`` (None
when it was left in place, because moving failed or this generation may no longer change
the directory).

A checkpoint without a signature (``unsigned``: one written before checkpoints were signed,
a forgery, or planted) is never loaded but stays where it is, so that ``ckpt trust`` can sign
it if the user vouches for it; one with a wrong signature (``forged``) is set aside like a
corrupt one. Either is moved aside when it holds the name of a step this job is about to
save (``move_unsigned``): the job's own checkpoint is never given up for it.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from elastic_harness.checkpoint import layout
from elastic_harness.checkpoint.storage import Storage
from elastic_harness.errors import os_reason


def stamp(now: float) -> str:
    """UTC time plus a random suffix: two set-asides of one step never collide."""
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + "-" + uuid.uuid4().hex[:6]


def set_aside(storage: Storage, name: str, reason: str, kind: str, *, events: Any, now: float,
              blocked: str = "", move_unsigned: bool = False) -> str | None:
    """Move ``name`` aside unless ``blocked`` says why not (or it is unsigned, unless
    ``move_unsigned``); emit the event; the new name or None."""
    new_name = layout.quarantine_name(name, stamp(now))
    stays = kind == "unsigned" and not move_unsigned
    why = blocked or ("unsigned: review it with 'elastic-harness ckpt trust RUN_DIR --step N' if you know "
                      "where it came from" if stays else "")
    if not why:
        try:
            storage.set_aside(name, new_name)
        except OSError as e:
            why = f"moving it aside failed: {os_reason(e)}"
    events.emit(
        "quarantine", step=layout.parse_step(name), name=name, reason=reason, kind=kind,
        moved_to=None if why else storage.uri(new_name),
        message=f"skipping {name}: {reason}" + (f" (left in place: {why})" if why else f"; set aside as {new_name}"),
    )
    return None if why else new_name
