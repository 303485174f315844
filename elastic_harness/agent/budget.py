"""An agent's restart budget over the job's progress (the decisions are ``launch.policy``'s).

torchelastic spends one of ``max_restarts`` per restart, for the agent's whole life. Here only
failures without progress count: each failure is noted at the job's highest completed step,
and those more than ``restart_window`` steps before the newest no longer count
(``policy.restarts_left``). The agent refills torch's counter from this when it settles a
failure, and asks it before one is settled (a peer's failure heard before any exit of its own
node: will a restart follow, so its workers are kept?).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic_harness.launch.policy import (
    budget_refill,
    exhausted_message,
    restarts_after_failure,
    restarts_left,
)


@dataclass
class RestartBudget:
    limit: int  # the user's max_restarts, before any refill
    window: int  # steps of progress after which a failure no longer counts (0: never)
    failure_steps: list[int] = field(default_factory=list)  # the job's progress at each failure settled
    exhausted: str | None = None  # why the budget ran out, once it did

    def settle(self, progress: int, last: str, counter: tuple[int, int]) -> tuple[int, int] | None:
        """One failure at step ``progress`` (``last``: its first failure, for the message):
        torch's ``(spec.max_restarts, _remaining_restarts)`` from ``counter`` refilled for the
        restarts left, or None when the budget is spent (``exhausted`` then says why)."""
        self.failure_steps.append(progress)
        left = restarts_left(self.failure_steps, self.limit, self.window)
        if left < 0:
            self.exhausted = exhausted_message(self.limit - left, self.limit, self.window, last)
            return None
        return budget_refill(*counter, left)

    def after_failure(self, progress: int) -> int:
        """torch's counter as it will read once a failure at ``progress`` is settled (0: no
        restart follows). Before that settling torch's own counter still reads what the last
        restart left, though the window may have forgiven that restart since."""
        if self.exhausted is not None:
            return 0
        return restarts_after_failure(self.failure_steps, progress, self.limit, self.window)
