"""A worker's uncaught exception, as an event the agent can reason about.

Each failure is recorded with a *signature*: a short hash of the exception type, its message
and the innermost frame of its traceback. Two generations that fail with the same signature
at the same step (after resuming from the same place) are a crash loop, not bad luck; the
agent (``launch.policy``) stops restarting then, instead of spending every restart on the
same error. A ``HarnessError`` (a mistake the user must fix) is recorded as ``fatal``. A
failure caused by a peer's connection closing (a peer's process died) says ``peer_lost``.
"""

from __future__ import annotations

import hashlib
import traceback
from dataclasses import dataclass
from typing import Any

from elastic_harness.errors import HarnessError
from elastic_harness.rendezvous.liveness import peer_lost as _peer_lost


def describe(exc: BaseException) -> dict[str, Any]:
    """``{message, where, signature}`` of an exception: one line, a place, a stable hash."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    message = f"{type(exc).__name__}: {text}"[:500] if text else type(exc).__name__
    digest = hashlib.sha256(f"{type(exc).__qualname__}|{text[:500]}|{where}".encode()).hexdigest()
    return {"message": message, "where": where, "signature": digest[:16]}


def peer_lost(exc: BaseException) -> bool:
    """Did this rank fail because a peer's connection closed or was reset (its process is
    gone), rather than by an error of its own? The agent reads the same words in the
    error file to drop a dead node sooner (``rendezvous.liveness``)."""
    return _peer_lost(str(exc))


@dataclass(frozen=True)
class Who:
    """Who failed: the rank, its node, the agent's restart count and the generation."""

    rank: int
    node: str = ""
    restart: int = 0
    generation: str = ""


def record(events: Any, exc: BaseException, who: Who, *, step: int | None,
           resumed_at: int | None = None, kept: int | None = None) -> None:
    """Emit a ``failure`` event for ``exc`` (never raises: it runs on the way down); ``kept``:
    the step this rank kept in its agent's memory on its way down (``memory_on_failure``)."""
    try:
        if isinstance(exc, HarnessError):
            events.emit("failure", fatal=True, message=str(exc), rank=who.rank, step=step, node=who.node,
                        restart=who.restart, generation=who.generation)
            return
        d = describe(exc)
        events.emit("failure", fatal=False, message=d["message"], where=d["where"],
                    signature=d["signature"], rank=who.rank, step=step, node=who.node, restart=who.restart,
                    generation=who.generation, resumed_at=resumed_at, peer_lost=peer_lost(exc), kept=kept)
    except Exception:  # noqa: BLE001 - the original exception must win
        pass


def exit_now(code: int, *, printed: bool = False) -> None:
    """End a worker whose failure is already recorded: the traceback to stderr (the agent's
    log) unless ``printed`` already, then no interpreter teardown (``procexit``): its agent
    is waiting for it before it can restart the group, and that teardown took 1.3 s on a
    quiet 2-core machine and over 3 s on a loaded one. Threads still running (a checkpoint write stuck on a dead peer)
    are not waited for."""
    from elastic_harness.procexit import exit_without_teardown

    if not printed:
        traceback.print_exc()
    exit_without_teardown(code)
