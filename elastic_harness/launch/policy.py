"""Pure: should an agent stop restarting its workers? Decided from the run's events.

torchelastic restarts a failed worker group until ``max_restarts`` is spent. Two kinds of
failure do not get better with a restart, and spending the budget on them only delays the
one line the user needs:

- a *fatal* failure: a mistake the user must fix (``HarnessError`` in a worker: an
  incompatible checkpoint, a bad evaluate, the API used wrongly);
- a *crash loop*: this node's last two attempts failed with the same exception (same
  signature: type, message, innermost frame) at the same step, or the same number of steps
  after each attempt's resume point. A restart from storage replays the same steps, so a
  deterministic bug fails again at the same step; a restart from the in-memory tier resumes
  where the last attempt failed, so a bug in, say, evaluation fails one step later each
  time, always the same distance from the resume. A SIGKILL or a lost peer leaves no
  signature and never counts.

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
    # An attempt's failures as keys (signature, how, step): how "at" = the step it failed at;
    # "after" = steps since its resume point, since with the in-memory tier each attempt
    # resumes where the previous one failed and the same bug then hits one step later.
    attempts: dict[int, set[tuple[str, str, int | None]]] = {}
    messages: dict[tuple[str, str, int | None], str] = {}
    resumes: dict[tuple[str, str, int | None], set[int | None]] = {}  # where each attempt started
    for e in mine:
        if not e.get("signature"):
            continue
        step, resumed = e.get("step"), e.get("resumed_at")
        keys = [(e["signature"], "at", step)]
        if step is not None and resumed is not None:
            keys.append((e["signature"], "after", step - resumed))
        for key in keys:
            attempts.setdefault(int(e.get("restart", 0)), set()).add(key)
            messages[key] = f"{e.get('message', '')} (at {e.get('where', '?')})"
            resumes.setdefault(key, set()).add(resumed)
    if len(attempts) < 2:
        return None
    last, before = sorted(attempts)[-1], sorted(attempts)[-2]
    if last != before + 1:
        return None
    repeated = attempts[last] & attempts[before]
    if not repeated:
        return None
    key = sorted(repeated, key=lambda k: (k[1] != "at", k[2] is None, k[2] or 0, k[0]))[0]
    if key[1] == "after":
        where = f"{key[2]} step(s) after resuming, each time"
    else:
        where = failed_at(key[2], resumes[key])
    return f"crash loop: the workers failed the same way twice {where}: {messages[key]}"


def failed_at(step: int | None, resumed: set[int | None]) -> str:
    """Pure: where the attempts failed, claiming only the start they really had: ``resumed``
    holds each attempt's ``resumed_at`` (0: a fresh start; None: failed before resuming)."""
    if step is None or (step == 0 and resumed <= {None}):
        return "before training started"
    if resumed == {0}:
        at = "in the first step" if step == 0 else f"at step {step}"
        return f"{at}, each time starting fresh (there was no checkpoint to resume from)"
    if len(resumed) == 1 and None not in resumed:
        return f"at step {step}, each time after resuming from step {next(iter(resumed))}"
    return f"at step {step}"


def agent_health(group_state: str, monitor_quiet_s: float, bound_s: float) -> tuple[bool, str]:
    """Pure: is this agent healthy, for ``/healthz``? ``group_state`` is torchelastic's
    worker-group state name; ``monitor_quiet_s`` the seconds since the agent's monitor loop
    last looked at its workers (it looks every ``timeouts.monitor_interval`` while they run,
    and not at all while a rendezvous or a restart is under way, which ``bound_s`` covers).
    """
    if group_state in ("FAILED", "UNHEALTHY"):
        return False, f"worker group {group_state.lower()}"
    if monitor_quiet_s > bound_s:
        return False, f"agent loop silent for {monitor_quiet_s:.0f}s (bound {bound_s:.0f}s)"
    return True, f"worker group {group_state.lower()}"


# ----- the restart budget ----------------------------------------------------------------------
# torchelastic's ``max_restarts`` is a lifetime budget: a job that recovers from every crash
# still dies at the (max_restarts + 1)-th one, however far apart they are. The harness spends
# it on failures *without progress* instead: each failure is stamped with the job's highest
# completed step when it was seen, and it stops counting once the job has completed
# ``restart_window`` more steps. Failures at the same high-water mark (failed restarts, a
# replay from storage that fails again before passing it) all count.


def restarts_left(failure_steps: list[int], max_restarts: int, window: int) -> int:
    """Pure: restarts this agent may still make after its newest failure (negative: none,
    the budget is spent). ``failure_steps``: the job's highest completed step at each of
    this agent's failures, oldest first, the newest included; ``window``: steps of progress
    after which a failure no longer counts (0: never, torchrun's lifetime budget)."""
    if not failure_steps:
        return max_restarts
    newest = max(failure_steps)
    counted = [s for s in failure_steps if window == 0 or s > newest - window]
    return max_restarts - len(counted)


def restarts_after_failure(failure_steps: list[int], progress: int, max_restarts: int, window: int) -> int:
    """Pure: torch's restart counter once a failure at step ``progress`` is settled
    (``budget_refill``: this restart and those left after it), 0 when none follows. Asked
    before that failure is settled (a peer's failure heard first), where torch's own counter
    still reads what the last restart left, though the window may have forgiven it since."""
    left = restarts_left([*failure_steps, progress], max_restarts, window)
    return left + 1 if left >= 0 else 0


def budget_refill(max_restarts: int, remaining: int, left: int) -> tuple[int, int]:
    """Pure: torchelastic's ``(spec.max_restarts, _remaining_restarts)`` that let it make
    this restart and ``left`` more, keeping its restart count (``max - remaining``, which
    numbers the attempts: events, store prefixes) as it is. torch takes one off
    ``_remaining_restarts`` as it restarts."""
    count = max_restarts - remaining
    return count + left + 1, left + 1


def exhausted_message(failures: int, max_restarts: int, window: int, last: str) -> str:
    """Pure: one line for a spent restart budget: the limit and how to raise it."""
    span = f"within {window} steps of progress" if window else "in this job's lifetime"
    times = f"{failures} time" + ("s" if failures != 1 else "")
    return (f"restarts used up: the workers failed {times} {span} (max_restarts={max_restarts}, "
            f"restart_window={window}); last: {last}; raise max_restarts (--set max_restarts=N, "
            "or --max-restarts N for an agent) or restart_window, then re-run to resume")


# ----- stopping a failed group -------------------------------------------------------------------
# When a worker of a group fails, torch's process contexts stop the rest with ``close()``, whose
# default grace is a fixed 30 s (``PContext.close(timeout=30)``) before SIGKILL. A survivor that
# does not exit on SIGTERM at once (blocked in a collective whose peer died without resetting the
# connection: gloo waits for ``timeouts.process_group``) held every such recovery for 30 s. A
# failed group has nothing to drain: it cannot save (a rank is gone) and each rank's in-memory
# snapshot already lives in its agent. A membership change or a stop request, which do save,
# keep ``timeouts.shutdown_grace``.
FAILED_STOP_GRACE_S = 3.0


def failed_stop_grace(shutdown_grace: float) -> float:
    """Pure: seconds the survivors of a failed group get after SIGTERM, before SIGKILL."""
    return min(float(shutdown_grace), FAILED_STOP_GRACE_S)


# ----- after the last step ------------------------------------------------------------------------
def finish_bound_s(process_group: float, shutdown_grace: float) -> float:
    """Pure: how long every rank may take to exit once the job's last step is done: a last
    collective with a slow peer (``timeouts.process_group``) and a last save
    (``timeouts.shutdown_grace``). The host waits this long for every agent (``commands.run``)
    and each agent this long for the others (torch's exit barrier) before stopping them; what
    is still running then is reported as cut short."""
    return float(process_group) + float(shutdown_grace)
