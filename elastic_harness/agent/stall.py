"""The agent's question when its workers stall: is a peer gone? (``rendezvous.verdict`` decides.)

The step watchdog (``agent.watchdog``) calls ``StallJudge`` once a worker is past the
stall bound it gave and before the hard bound (``timeouts.step``). It gathers the evidence
(the peers of the last round from the rendezvous handler's last read of the state, and the
beacons of the suspects: ``rendezvous.probe``), asks ``verdict.judge``, and when peers are gone
tells the handler (``condemn``: dropped at the next read of the state) before the watchdog
stops the workers. It asks at most once every ``every_s``, from the watchdog's thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from elastic_harness.rendezvous import verdict
from elastic_harness.rendezvous.probe import Asker


class StallJudge:
    def __init__(self, handler: Any, ask: Callable[[str], str] | None = None, every_s: float = 0.25,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.handler, self.every_s, self.clock = handler, every_s, clock
        self._ask = ask or Asker(timeout_s=0.5, keep_s=0.0)  # a fresh answer each time
        self._last = float("-inf")

    def __call__(self, stalled_s: float, bound_s: float) -> verdict.Verdict:
        now = self.clock()
        if now - self._last < self.every_s:
            return verdict.Verdict()
        self._last = now
        seen = getattr(self.handler, "peers_now", lambda: None)()
        if seen is None:
            return verdict.Verdict()
        peers, beacons = seen
        answers = {node: self._ask(beacons[node]) for node in verdict.suspects(peers) if node in beacons}
        found = verdict.judge(stalled_s=stalled_s, stall_bound_s=bound_s, peers=peers, answers=answers)
        if found.gone:
            self.handler.condemn(found.gone)
        return found
