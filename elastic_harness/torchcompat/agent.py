"""torchelastic's agent, process context, timer server and event handlers: the private hooks
``launch/`` builds on, under public names.

torchelastic's ``SimpleElasticAgent`` is meant to be subclassed, but its hooks are
underscored (``_start_workers``, ``_stop_workers``, ``_monitor_workers``, ``_shutdown``) and
so is its state (``_pcontext``, ``_worker_group``, ``_remaining_restarts``). ``AgentBase``
is ``LocalElasticAgent`` with those hooks forwarded to ``start_workers``, ``stop_workers``,
``monitor_workers`` and ``shutdown``, and that state as properties; ``agent.elastic``
subclasses it and never spells an underscored torch name. The same for ``ContextBase``
(torchelastic's ``PContext``: ``start_processes``, ``poll_processes``, ``close_processes``) and ``TimerServerBase``
(``FileTimerServer``: ``reap_worker``, and a ``stop`` that ends the watchdog's thread).

The shutdown grace is ours (``shutdown_grace``): torch 2.11's agent has no
``shutdown_timeout`` and stops workers with a fixed 30 s; there the process context is
closed with the grace first, and torch's ``_shutdown`` then finds nothing left.

Features (``probe``): ``agent`` (required: the harness's agent is built on it), ``warm-start``
(the module's ``start_processes`` swapped while workers start, and ``PContext``'s abstract
methods; off: every worker is a fresh interpreter), ``watchdog-reap`` (off: no step
watchdog, since torch's own reap kills the agent too), ``event-bridge`` (torchelastic's handler table; off: its events and the
rendezvous' stay out of events.jsonl).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

from torch.distributed.elastic.agent.server import local_elastic_agent as _la
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.events import handlers as _handlers
from torch.distributed.elastic.multiprocessing.api import PContext
from torch.distributed.elastic.timer.file_based_local_timer import FileTimerServer

from elastic_harness.torchcompat.probe import attrs, feature, instance_attrs, on, parameters

_HOOKS = ("_start_workers", "_stop_workers", "_monitor_workers", "_shutdown")
_CONTEXT_ABSTRACT = {"_start", "_poll", "_close", "pids"}  # what ``ContextBase`` implements
TIMER_STOP_S = 5.0  # how long ``TimerServerBase.stop`` waits for the watchdog's thread to end


@feature("agent", "elastic agent", "nothing: the harness's agent is built on these", required=True)
def _agent() -> list[str]:
    gone = attrs(LocalElasticAgent, *_HOOKS)
    gone += [f"LocalElasticAgent.{h} (abstract)" for h in _HOOKS
             if getattr(getattr(LocalElasticAgent, h, None), "__isabstractmethod__", False)]
    return gone + instance_attrs(LocalElasticAgent, "_pcontext", "_worker_group", "_remaining_restarts")


@feature("warm-start", "warm worker starts",
         "every worker starts as a fresh interpreter (a restart pays import torch, seconds)")
def _warm() -> list[str]:
    extra = set(getattr(PContext, "__abstractmethods__", ())) - _CONTEXT_ABSTRACT
    return [*attrs(_la, "start_processes", label="local_elastic_agent"),
            *(f"PContext.{n} (a new abstract method)" for n in sorted(extra)),
            *attrs(PContext, *sorted(_CONTEXT_ABSTRACT - {"pids"}))]


@feature("watchdog-reap", "step watchdog",
         "a hung worker is not killed: it waits for its process group's timeout (torch's own "
         "timer server would kill the agent with it)")
def _reap() -> list[str]:
    return [*attrs(FileTimerServer, "_reap_worker"), *instance_attrs(FileTimerServer, "_timers")]


@feature("event-bridge", "torchelastic events in events.jsonl",
         "torchelastic's and the rendezvous' own events are not recorded (the report lacks the "
         "rendezvous phases of a recovery)")
def _bridge() -> list[str]:
    return attrs(_handlers, "_log_handlers", label="events.handlers")


def _takes_timeout() -> bool:
    return not parameters(LocalElasticAgent._shutdown, "timeout", label="_shutdown")


class AgentBase(LocalElasticAgent):
    """``LocalElasticAgent`` with its private hooks under public names (module doc)."""

    def __init__(self, *args: Any, shutdown_grace: float = 30.0, **kwargs: Any) -> None:
        if not parameters(LocalElasticAgent.__init__, "shutdown_timeout", label="LocalElasticAgent"):
            kwargs["shutdown_timeout"] = shutdown_grace
        super().__init__(*args, **kwargs)
        self.shutdown_grace = shutdown_grace

    # torch calls the underscored hooks; subclasses override the public ones.
    def _start_workers(self, worker_group: Any) -> dict[int, Any]:
        return self.start_workers(worker_group)

    def _stop_workers(self, worker_group: Any, *args: Any, **kwargs: Any) -> None:
        self.stop_workers(worker_group)

    def _monitor_workers(self, worker_group: Any) -> Any:
        return self.monitor_workers(worker_group)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, *args: Any, **kwargs: Any) -> None:
        self.shutdown(death_sig, kwargs.get("timeout"))

    def start_workers(self, worker_group: Any) -> dict[int, Any]:
        return super()._start_workers(worker_group)

    def stop_workers(self, worker_group: Any) -> None:
        super()._stop_workers(worker_group)

    def monitor_workers(self, worker_group: Any) -> Any:
        return super()._monitor_workers(worker_group)

    def shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: float | None = None) -> None:
        """Stop the workers (``death_sig``, then SIGKILL after ``timeout``, default the grace)."""
        grace = self.shutdown_grace if timeout is None else timeout
        if _takes_timeout():
            super()._shutdown(death_sig, timeout=grace)
            return
        if self._pcontext is not None:  # torch 2.11: its own close would wait a fixed 30 s
            self._pcontext.close(death_sig, grace)
        super()._shutdown(death_sig)

    @property
    def pcontext(self) -> Any | None:
        return self._pcontext

    @property
    def worker_group(self) -> Any:
        return self._worker_group

    @property
    def remaining_restarts(self) -> int:
        return self._remaining_restarts

    @remaining_restarts.setter
    def remaining_restarts(self, value: int) -> None:
        self._remaining_restarts = value


class ContextBase(PContext):
    """torchelastic's ``PContext`` with its abstract hooks under public names: a subclass
    implements ``start_processes()``, ``poll_processes()``, ``close_processes(death_sig,
    timeout)`` and ``pids()``; torch's public ``start()``, ``wait()`` and ``close()`` call them."""

    def start_processes(self) -> None:
        raise NotImplementedError

    def poll_processes(self) -> Any:
        raise NotImplementedError

    def close_processes(self, death_sig: signal.Signals, timeout: int = 30) -> None:
        raise NotImplementedError

    def _start(self) -> None:
        self.start_processes()

    def _poll(self) -> Any:
        return self.poll_processes()

    def _close(self, death_sig: signal.Signals, timeout: int = 30) -> None:
        self.close_processes(death_sig, timeout)


class TimerServerBase(FileTimerServer):
    """torchelastic's ``FileTimerServer`` with ``reap_worker(pid, signal) -> bool`` public
    (called where torch reaps), its timer table readable (``timers``), and a ``stop`` that
    ends its thread; only run where ``watchdog-reap`` is on."""

    def stop(self) -> None:
        """torch's ``stop``, once the watchdog's thread ended (at most ``TIMER_STOP_S``).

        torch signals the thread and waits one ``max_interval`` for it. A thread that no
        worker ever wrote to (an agent whose workers never started) is not in its loop but
        in ``open()`` of the FIFO, waiting for a first writer, and torch's removal of the
        FIFO does not wake it: it stayed for the life of the process. Opening the FIFO for
        writing without blocking wakes it (a reader waiting in ``open()`` counts as one);
        it then sees the stop and ends. Without the private names (another torch):
        torch's own ``stop``."""
        thread, fifo = getattr(self, "_watchdog_thread", None), getattr(self, "_file_path", None)
        if thread is not None and fifo:
            self._stop_signaled = True
            deadline = time.monotonic() + TIMER_STOP_S
            while thread.is_alive() and time.monotonic() < deadline:
                with contextlib.suppress(OSError):  # ENXIO: nobody has it open for reading (yet)
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                thread.join(0.05)
        super().stop()

    def _reap_worker(self, worker_pid: int, signal: int) -> bool:
        return self.reap_worker(worker_pid, signal)

    def reap_worker(self, worker_pid: int, signal: int) -> bool:
        return super()._reap_worker(worker_pid, signal)

    def timers(self) -> dict:
        """The armed timers: ``{(worker pid, scope id): request}`` (torch's table, read only)."""
        return self._timers


@contextlib.contextmanager
def processes_from(make: Callable[..., Any]) -> Iterator[bool]:
    """While this block runs, torchelastic's agent starts its workers with ``make`` (same
    arguments as torch's ``start_processes``, which it receives as ``cold=``) instead of
    torch's ``start_processes``; yields False (nothing swapped) when ``warm-start`` is off.
    The agent's main thread is the only caller."""
    if not on("warm-start"):
        yield False
        return
    cold = _la.start_processes

    def swapped(*args: Any, **kwargs: Any) -> Any:
        return make(*args, cold=cold, **kwargs)

    _la.start_processes = swapped
    try:
        yield True
    finally:
        _la.start_processes = cold


def register_event_handler(name: str, handler: Any) -> Callable[[], None] | None:
    """Make ``handler`` (a logging handler) torchelastic's event destination ``name``;
    returns the undo (None: ``event-bridge`` is off, nothing registered)."""
    if not on("event-bridge"):
        return None
    table = _handlers._log_handlers
    before = table.get(name)
    table[name] = handler

    def undo() -> None:
        if before is None:
            table.pop(name, None)
        else:
            table[name] = before

    return undo
