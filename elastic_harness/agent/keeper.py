"""The agent's part of in-place recovery (docs/in-place.md): which workers it keeps.

``Keeper`` belongs to a ``HarnessAgent`` with warm starts and ``recovery: in_place``. It holds
the control lines and the workers kept from one group to the next (``agent.warm.Keep``), and
answers the agent's questions at the points of torchelastic's loop where a fault is handled:

- ``hear`` (each monitor pass): a worker said ``broken`` (a collective of its failed: a peer
  is lost or left); the round is broken for every peer, and the group goes in place;
- ``leave_on_verdict`` (the step watchdog's thread): a stalled worker's verdict is "a peer
  is gone"; in place the group leaves its step instead of being killed;
- ``applies``: is the next restart in place (one follows, nothing stopped the agent)?
- ``keep_survivors`` (torch stops the failed group for its restart): the workers that parked
  within the bound are released from the old process context and kept; the others are killed
  now (no drain is possible in a broken generation) and forked anew;
- ``started``: the new group started (its kept workers adopted by ``agent.warm``).
"""

from __future__ import annotations

import contextlib
import logging
import select
import signal
import time
from typing import Any

from elastic_harness.agent.warm import Keep, WarmContext
from elastic_harness.agent.zygote import Zygote, ZygoteLost
from elastic_harness.rendezvous import liveness

log = logging.getLogger(__name__)
LATE_EXIT_S = 1.0  # how long a survivor's group waits, parked, for a dead peer's exit to be reported


class Keeper:
    def __init__(self, zygote: Zygote, park_bound_s: float) -> None:
        self.keep = Keep()
        self.zygote, self.park_bound_s = zygote, park_bound_s
        self.leave_reason: str | None = None  # a peer's failure the group must leave for
        self.verdict: str | None = None  # the watchdog's verdict the group must leave for
        self.restart_follows = False  # the last failed pass left restarts: torch restarts the group
        self.ended: dict[int, Any] = {}  # local rank -> ProcessFailure: workers ended when the group parked

    def fds(self) -> list[int]:
        """The control lines' descriptors (the agent's wait for news ends on a message)."""
        return list(self.keep.lines.fileno_map())

    def applies(self, pcontext: Any, remaining_restarts: int, stopped: bool) -> bool:
        """Is the next restart of the group in place (its survivors kept)? Only when one
        follows: with no restart left the group is stopped as before, and its exits say why."""
        return isinstance(pcontext, WarmContext) and remaining_restarts > 0 and not stopped

    def restarting(self, result: Any, pcontext: Any, remaining_restarts: int, stopped: bool) -> Any:
        """A group whose peer failed restarts in place with its workers alive: torch must see
        it failed (and restart it), though none of its workers ended."""
        from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

        if result.state == WorkerState.HEALTHY and self.applies(pcontext, remaining_restarts, stopped):
            return RunResult(state=WorkerState.FAILED)
        return result

    def leave(self, pcontext: Any) -> None:
        """Every worker leaves its step (``leave_word``)."""
        reason, remote = leave_word(self.leave_reason, self.verdict)
        pcontext.leave(reason, remote=remote)

    def hear(self, handler: Any, healthy: bool) -> bool:
        """What the workers said on their lines; True when one said ``broken`` and the group
        is to leave its step: the round is then broken for every peer, as a worker's exit
        with that error would break it (``group_failed``, ``peer_lost``)."""
        broken = False
        for pid, msg in self.keep.lines.hear():
            if msg.get("op") != "broken" or broken or not healthy:
                continue
            reason = str(msg.get("reason", ""))
            log.info("worker %s: a collective failed (%s); the group re-forms in place", pid, reason[:300])
            if liveness.peer_lost(reason) and hasattr(handler, "peer_lost"):
                handler.peer_lost()
            if hasattr(handler, "group_failed"):
                handler.group_failed()
            self.leave_reason, broken = f"a collective failed: {reason[:200]}", True
        return broken

    def leave_on_verdict(self, pid: int, reason: str) -> bool:
        """The step watchdog's verdict on a stalled worker (a peer is gone; its thread): every
        worker of the group leaves its step and the group re-forms without the peer; False
        (kill it, as before) when this worker cannot (it never said it is live)."""
        if pid not in self.keep.lines.live:
            return False
        self.verdict = reason
        return True

    def keep_survivors(self, pcontext: Any, bound_s: float | None = None) -> bool:
        """A group about to restart (it failed, or a node joins): its live workers that park
        within the bound (``park_bound_s``, or ``bound_s``) are kept for the next group
        (released from ``pcontext``); the others are killed now and forked anew. Whether every
        worker waited for parked."""
        if not isinstance(pcontext, WarmContext):
            return True
        hung = pcontext.hung()  # stopped (a signal, a tracer, D-state): it cannot park, nor be waited for
        live = {lr: pid for lr, pid in pcontext.live().items() if lr not in hung}
        parked, wanted = await_parked(self.keep.lines, live, self.zygote,
                                      self.park_bound_s if bound_s is None else bound_s)
        await_exits(self.zygote, {pid for pid in live.values() if pid not in parked}, LATE_EXIT_S)
        self.ended = pcontext.ended()  # before the unparked are killed: the exits that are the fault
        self.keep.kept = {lr: pid for lr, pid in live.items() if pid in parked}
        pcontext.release(self.keep.kept)
        for pid in wanted - parked:  # stuck somewhere it cannot leave: no drain is possible
            with contextlib.suppress(ZygoteLost):
                self.zygote.signal(pid, signal.SIGKILL)
        return parked == wanted

    def started(self) -> None:
        self.keep.discard(self.zygote)  # kept workers no local rank took (none expected)
        self.leave_reason = self.verdict = None

    def discard(self) -> None:
        self.keep.discard(self.zygote)


def leave_word(leave_reason: str | None, verdict: str | None) -> tuple[str, bool]:
    """Pure: what the workers are told when their group's round broke: the reason, and whether
    the failure is another node's (``remote``): so it is unless a worker of this node said a
    collective of its failed (that collective may have been within the node). The watchdog's
    verdict is evidence against another node (``rendezvous.verdict``: gone or silent), a
    worker of this node only waiting on it. A remote word leaves the collectives within the
    node running until the step's backward is done (``runtime.inplace``)."""
    return leave_reason or verdict or "a peer's group failed", leave_reason is None


def await_exits(zygote: Zygote | None, pids: set[int], bound_s: float) -> None:
    """Until the zygote reported the exit of each of ``pids`` or ``bound_s`` passed: a worker
    that died may be reported after its peers' failed collective was heard and they parked."""
    deadline = time.monotonic() + bound_s
    while zygote is not None and pids - set(zygote.poll(0.0)) and time.monotonic() < deadline:
        zygote.poll(min(0.05, max(0.0, deadline - time.monotonic())))


def await_parked(lines: Any, live: dict[int, int], zygote: Zygote | None, bound_s: float
                 ) -> tuple[set[int], set[int]]:
    """The pids among ``live`` that said ``parked`` on their line within ``bound_s`` (or had
    said it already), and those waited for. Only workers still running that said they are
    ``live`` (a script that does not use the harness's groups never does) are waited for; one
    that exits meanwhile, or whose line closes, is not."""
    deadline = time.monotonic() + bound_s
    while True:
        lines.hear()
        exits = zygote.poll(0.0) if zygote is not None else {}
        wanted = {pid for pid in live.values() if pid in lines.live and pid not in exits}
        parked = {pid for pid in wanted if any(m.get("op") == "parked" for m in lines.heard.get(pid, []))}
        left = deadline - time.monotonic()
        if parked == wanted or left <= 0:
            return parked, wanted
        fds = list(lines.fileno_map())
        if zygote is not None and zygote.fileno() is not None:
            fds.append(zygote.fileno())
        select.select(fds, [], [], min(left, 0.05))
