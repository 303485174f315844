"""torchelastic's agent, with the two behaviours we need changed, and a launcher for it.

``HarnessAgent`` is torchelastic's ``LocalElasticAgent`` (rendezvous, worker processes,
monitoring, restarts: all torch's) with two overrides:

- ``_stop_workers``: torch stops the worker group for a restart or a membership change
  with a fixed 30 s grace; a drain that saves a large state needs
  ``timeouts.shutdown_grace`` (the launch config's shutdown timeout, which torch already
  uses when the agent itself is signalled).
- ``_monitor_workers``: when the group failed, ask ``judge()`` (``launch.policy``: fatal
  error or crash loop?) and, if it gives a reason, spend no more restarts. It also notes
  when it last ran, so ``health()`` can tell a live agent from a stuck one.

``Launch`` does what ``torch.distributed.launcher.api.launch_agent`` does (rendezvous
parameters from the config, the worker spec, run, record torchelastic's own events, shut
the rendezvous down unless a signal ended the agent) with our agent class, which
``launch_agent`` does not let a caller choose, and the rendezvous handler of
``launch.rendezvous``. Dynamic rendezvous only (c10d, etcd): the
master address and port come from the rendezvous.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic import events, metrics
from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_harness.launch import rendezvous
from elastic_harness.launch.policy import agent_health


class HarnessAgent(LocalElasticAgent):
    def __init__(self, *args: Any, judge: Callable[[], str | None], quiet_bound_s: float = 300.0,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._judge = judge
        self._quiet_bound_s = quiet_bound_s
        self._last_monitor = time.monotonic()
        self.stop_reason: str | None = None

    def health(self) -> tuple[bool, str]:
        """For the agent endpoint's ``/healthz`` (any thread; reads two fields, never blocks)."""
        state = self._worker_group.state.name
        return agent_health(state, time.monotonic() - self._last_monitor, self._quiet_bound_s)

    def _stop_workers(self, worker_group: Any) -> None:
        self._shutdown(timeout=self._shutdown_timeout)

    def _monitor_workers(self, worker_group: Any) -> RunResult:
        self._last_monitor = time.monotonic()
        result = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and self.stop_reason is None:
            reason = self._judge()
            if reason:
                self.stop_reason = reason
                self._remaining_restarts = 0
        return result


class Launch:
    """One node's agent for ``config``; ``run()`` once. ``agent.stop_reason`` says why it
    stopped restarting, when it did."""

    def __init__(self, config: Any, entrypoint: Callable | str, args: list[Any],
                 judge: Callable[[], str | None], quiet_bound_s: float = 300.0) -> None:
        params = RendezvousParameters(
            backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id,
            min_nodes=config.min_nodes, max_nodes=config.max_nodes, local_addr=config.local_addr,
            **config.rdzv_configs,
        )
        self.config = config
        self.spec = WorkerSpec(
            role=config.role, local_world_size=config.nproc_per_node, entrypoint=entrypoint,
            args=tuple(args), rdzv_handler=rendezvous.create_handler(params),
            max_restarts=config.max_restarts, monitor_interval=config.monitor_interval,
            master_addr=None, master_port=None, local_addr=config.local_addr,
            event_log_handler=config.event_log_handler,
        )
        self.agent = HarnessAgent(spec=self.spec, logs_specs=config.logs_specs,
                                  start_method=config.start_method,
                                  shutdown_timeout=config.shutdown_timeout, judge=judge,
                                  quiet_bound_s=quiet_bound_s)

    def run(self) -> dict[int, Any]:
        """Run to the end; raises what ``launch_agent`` raises (``ChildFailedError``,
        ``SignalException``, rendezvous errors)."""
        config, agent, spec = self.config, self.agent, self.spec
        shutdown_rdzv = True
        try:
            metrics.initialize_metrics(metrics.MetricsConfig(config.metrics_cfg))
            result = agent.run()
            events.record(agent.get_event_succeeded(), config.event_log_handler)
            if result.is_failed():
                raise ChildFailedError(name=spec.get_entrypoint_name(), failures=result.failures)
            return result.return_values
        except ChildFailedError:
            raise
        except SignalException:
            # A signalled agent leaves the rendezvous open so the job can go on without it.
            shutdown_rdzv = False
            events.record(agent.get_event_failed(), config.event_log_handler)
            raise
        except Exception:
            events.record(agent.get_event_failed(), config.event_log_handler)
            raise
        finally:
            if shutdown_rdzv:
                spec.rdzv_handler.shutdown()
