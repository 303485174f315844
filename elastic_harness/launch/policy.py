"""Pure: should an agent stop restarting its workers? Decided from the run's events.

torchelastic restarts a failed worker group until ``max_restarts`` is spent. Two kinds of
failure do not get better with a restart, and spending the budget on them only delays the
one line the user needs:

- a *fatal* failure: a mistake the user must fix (``HarnessError`` in a worker: an
  incompatible checkpoint, a bad evaluate, the API used wrongly);
- a *crash loop*: this node's last two attempts failed with the same exception (same
  signature: type, message, innermost frame) at the same step. A restart resumes from the
  same checkpoint and replays the same steps, so a deterministic bug fails again at the
  same place. A SIGKILL or a lost peer leaves no signature and never counts.

Each agent judges its own node's attempts (``node``, and ``restart`` = torchelastic's
restart count) among the failures recorded since it started (``since``).
"""

from __future__ import annotations

from collections.abc import Iterable


def stop_reason(events: Iterable[dict], node: str, since: float) -> str | None:
    """A one-line reason to stop restarting, or None to let torchelastic restart."""
    mine = [e for e in events if e.get("event") == "failure" and e.get("t", 0.0) >= since
            and str(e.get("node", "")) == node]
    fatal = [e for e in mine if e.get("fatal")]
    if fatal:
        return str(fatal[-1].get("message", "a fatal error"))
    attempts: dict[int, set[tuple[str, int | None]]] = {}
    messages: dict[tuple[str, int | None], str] = {}
    for e in mine:
        if not e.get("signature"):
            continue
        key = (e["signature"], e.get("step"))
        attempts.setdefault(int(e.get("restart", 0)), set()).add(key)
        messages[key] = f"{e.get('message', '')} (at {e.get('where', '?')})"
    if len(attempts) < 2:
        return None
    last, before = sorted(attempts)[-1], sorted(attempts)[-2]
    if last != before + 1:
        return None
    repeated = attempts[last] & attempts[before]
    if not repeated:
        return None
    key = sorted(repeated, key=lambda k: (k[1] is None, k[1] or 0, k[0]))[0]
    where = f"at step {key[1]}" if key[1] is not None else "before training started"
    return (f"crash loop: the workers failed the same way twice {where}, after resuming from "
            f"the same checkpoint: {messages[key]}")
