"""torch's dynamic rendezvous: the private names ``rendezvous.handler`` reaches, and its patches.

torch has no hook for what ``rendezvous.handler`` adds to its ``DynamicRendezvousHandler``
(a last call decided per round, a dead peer dropped on evidence, events without
``inspect.stack()``), so these remain patches. Each is a feature of ``probe``:

- ``rdzv-events``: the module's ``get_method_name`` and ``construct_and_record_rdzv_event``
  replaced (the same events, microseconds instead of 20-30 ms each);
- ``rdzv-delay``: the module's ``_delay`` replaced (no start-up skew at a restart, 0.25 s polls);
- ``rdzv-state``: the handler's state holder read and its cache duration set (per-round last
  call, the state polls, "is a group running?", "is my round broken?");
- ``rdzv-fast-path``: the holder's ``_sanitize`` and the executor's ``_keep_alive`` wrapped
  per handler (a lost node dropped on evidence, each agent's identity written with its
  keep-alive, the keep-alive gaps the stall verdict reads), torch's
  ``_remove_participant_epilogue`` called, the handler's heartbeat lock taken;
- ``rdzv-early-close``: the executor's join operations wrapped (a later round closes once
  everyone expected joined; a hot spare polls faster, and leaves the redundancy list in the
  write that lists it elsewhere; a round never holds more than ``nodes.max``, and a round an
  admission filled is completed in that write);
- ``rdzv-host-guess``: torch's guess whether this machine hosts the c10d store;
- ``rdzv-sealed-state`` (required): torch's empty ``_RendezvousState``, what a refused
  (forged, corrupt) rendezvous value reads as before an authentic one was seen: the sealed
  state (``rendezvous.sealed``) is a security feature, never switched off; and each of its
  fields (``STATE_FIELDS``), probed one by one on a fresh state: the rendezvous reads torch's
  state only as a ``StateView`` made here, so a field torch renames is one line at start-up.

Every field name of torch's state is spelled in this module: read through ``view`` (a frozen
copy), written through the few writers below (``admit``, ``make_spares``, ``drop``, ...).

Module patches (``patch_module``) are applied by the agent's ``create_handler`` only, kept
in ``PATCHED`` and undone by ``undo_module_patches``; handler hooks (``hook_handler``)
return their own undo. Tests undo both (tests/conftest.py).
"""

from __future__ import annotations

import pickle
import socket
import sys
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from types import MappingProxyType
from typing import Any

from torch.distributed.elastic.rendezvous import dynamic_rendezvous as _dr
from torch.distributed.elastic.rendezvous import utils as _utils

from elastic_harness.torchcompat.probe import attrs, feature, instance_attrs, on

_Handler = _dr.DynamicRendezvousHandler
_Holder = getattr(_dr, "_BackendRendezvousStateHolder", None)
_Executor = getattr(_dr, "_DistributedRendezvousOpExecutor", None)

# torch's own module functions, looked up once (None where this torch has none).
TORCH_GET_METHOD_NAME = getattr(_dr, "get_method_name", None)
TORCH_RECORD_EVENT = getattr(_dr, "construct_and_record_rdzv_event", None)
TORCH_DELAY = getattr(_dr, "_delay", None)
_REMOVE_EPILOGUE = getattr(_dr, "_remove_participant_epilogue", None)
_MATCHES_HOST = getattr(_utils, "_matches_machine_hostname", None)

PATCHED: dict[str, Any] = {}  # module attribute -> torch's value, while replaced


@feature("rdzv-events", "fast rendezvous events",
         "each rendezvous event names its caller through inspect.stack() (20-30 ms an event)")
def _events() -> list[str]:
    return attrs(_dr, "get_method_name", "construct_and_record_rdzv_event", label="dynamic_rendezvous")


@feature("rdzv-delay", "restart join without skew",
         "a restart's first join sleeps torch's random 0-0.3 s and waiting agents poll every 1 s")
def _delay() -> list[str]:
    return attrs(_dr, "_delay", label="dynamic_rendezvous")


@feature("rdzv-state", "per-round last call",
         "every round waits rendezvous.start_last_call, the state is re-read every 1 s, and a "
         "joining node always drains a running group first")
def _state() -> list[str]:
    if _Holder is None:
        return ["dynamic_rendezvous._BackendRendezvousStateHolder"]
    return [*instance_attrs(_Handler, "_state_holder", "_settings", "_this_node"),
            *instance_attrs(_Holder, "_cache_duration", "_backend", "_last_sync_time"),
            *attrs(_Holder, "state", "sync", label="_BackendRendezvousStateHolder")]


@feature("rdzv-fast-path", "rendezvous fast path",
         "a lost node is dropped when its keep-alives expire")
def _fast_path() -> list[str]:
    if _Holder is None or _Executor is None:
        return ["dynamic_rendezvous._BackendRendezvousStateHolder/_DistributedRendezvousOpExecutor"]
    return [*_state(), *attrs(_Holder, "_sanitize", label="_BackendRendezvousStateHolder"),
            *attrs(_Executor, "_keep_alive", label="_DistributedRendezvousOpExecutor"),
            *instance_attrs(_Executor, "_state"),
            *instance_attrs(_Handler, "_op_executor", "_heartbeat_lock"),
            *attrs(_Handler, "_stop_heartbeats", label="DynamicRendezvousHandler"),
            *attrs(_dr, "_remove_participant_epilogue", label="dynamic_rendezvous")]


_OPERATIONS = ("_add_to_participants", "_mark_rendezvous_complete", "_add_to_redundancy_list",
               "_remove_from_redundancy_list", "_add_to_wait_list")


@feature("rdzv-early-close", "early round close",
         "a later round waits its last call even when everyone expected has joined, and a hot "
         "spare reads the state every 0.25 s")
def _early_close() -> list[str]:
    if _Executor is None:
        return ["dynamic_rendezvous._DistributedRendezvousOpExecutor"]
    return [*_fast_path(), *attrs(_Executor, *_OPERATIONS, label="_DistributedRendezvousOpExecutor")]


# torch's ``_RendezvousState`` fields the rendezvous reads (``StateView``), in torch's order.
STATE_FIELDS = ("round", "complete", "deadline", "closed", "participants", "wait_list", "redundancy_list",
                "last_heartbeats")


@feature("rdzv-sealed-state", "sealed rendezvous state",
         "nothing: a forged or corrupt state must read as a fresh one", required=True)
def _sealed_state() -> list[str]:
    found = attrs(_dr, "_RendezvousState", label="dynamic_rendezvous")
    return found or attrs(_dr._RendezvousState(), *STATE_FIELDS, label="_RendezvousState")


@dataclass(frozen=True)
class StateView:
    """torch's rendezvous state as the rendezvous reads it: a frozen copy (``view``), never
    the object torch keeps changing. The defaults are torch's fresh state."""

    round: int = 0
    complete: bool = False
    deadline: datetime | None = None
    closed: bool = False
    participants: Mapping = field(default_factory=lambda: MappingProxyType({}))  # node -> rank
    wait_list: frozenset = frozenset()
    redundancy_list: frozenset = frozenset()
    last_heartbeats: Mapping = field(default_factory=lambda: MappingProxyType({}))  # node -> last keep-alive (UTC)


def view(state: Any) -> StateView:
    """A frozen copy of torch's ``state`` (its fields: ``STATE_FIELDS``)."""
    return StateView(round=state.round, complete=state.complete, deadline=state.deadline, closed=state.closed,
                     participants=MappingProxyType(dict(state.participants)),
                     wait_list=frozenset(state.wait_list), redundancy_list=frozenset(state.redundancy_list),
                     last_heartbeats=MappingProxyType(dict(state.last_heartbeats)))


# --- writers of torch's state (inside a join operation or a sync: the state about to be written)

def admit(state: Any, nodes: Iterable) -> None:
    """Make ``nodes`` participants of the open round (off the wait and redundancy lists)."""
    for node in nodes:
        state.wait_list.discard(node)
        state.redundancy_list.discard(node)
        state.participants[node] = 0


def make_spares(state: Any, nodes: Iterable) -> None:
    """Move ``nodes`` from the wait list to the redundancy list (hot spares)."""
    for node in nodes:
        state.wait_list.discard(node)
        state.redundancy_list.add(node)


def off_wait_list(state: Any, node: Any) -> None:
    state.wait_list.discard(node)


def set_deadline(state: Any, when: datetime | None) -> None:
    """When the open round closes (torch's last call)."""
    state.deadline = when


def drop(state: Any, node: Any) -> None:
    """Remove ``node`` from the state as torch's expiry does (keep-alive, participant, lists)."""
    state.last_heartbeats.pop(node, None)
    state.participants.pop(node, None)
    state.wait_list.discard(node)
    state.redundancy_list.discard(node)


def fresh_state() -> bytes:
    """torch's empty rendezvous state, pickled (what its state holder starts from)."""
    return pickle.dumps(_dr._RendezvousState())


@feature("rdzv-host-guess", "c10d store host guess",
         "this machine hosts the c10d store only when the endpoint names it by its hostname or a "
         "loopback address (set rendezvous is_host to be exact)")
def _host_guess() -> list[str]:
    return attrs(_utils, "_matches_machine_hostname", label="rendezvous.utils")


# --- module patches ------------------------------------------------------------------------

def patch_module(method_name: Callable, record_event: Callable, delay: Callable) -> None:
    """Replace torch's module functions where their features are on (idempotent)."""
    wanted = {}
    if on("rdzv-events"):
        wanted.update(get_method_name=method_name, construct_and_record_rdzv_event=record_event)
    if on("rdzv-delay"):
        wanted["_delay"] = delay
    for name, ours in wanted.items():
        PATCHED.setdefault(name, getattr(_dr, name))
        setattr(_dr, name, ours)


_PACES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # handler or executor -> its pace


def pace_with(handler: Any, pace: Any) -> None:
    """``pace`` answers for the handler's joins where torch calls its module's ``_delay``:
    the handler's ``next_rendezvous`` (the start-up skew) and its executor's ``run`` (the
    poll). Found again by ``caller_pace`` from the caller's ``self``: no thread-local."""
    _PACES[handler] = pace
    executor = getattr(handler, "_op_executor", None)
    if executor is not None:
        _PACES[executor] = pace


def caller_pace(depth: int = 2) -> Any | None:
    """The pace ``pace_with`` gave the handler or executor whose method called the function
    ``depth`` frames up from this one (torch's ``_delay``, replaced); None for any other."""
    try:
        owner = sys._getframe(depth).f_locals.get("self")
        return _PACES.get(owner) if owner is not None else None
    except (ValueError, TypeError):  # the stack is not that deep; an owner that cannot be weakly referenced
        return None


def undo_module_patches() -> None:
    while PATCHED:
        name, theirs = PATCHED.popitem()
        setattr(_dr, name, theirs)


# --- a handler's internals -----------------------------------------------------------------

def state_holder(handler: Any) -> Any | None:
    """The handler's state holder (``sync()``, ``state``), None when ``rdzv-state`` is off."""
    return getattr(handler, "_state_holder", None) if on("rdzv-state") else None


def state(handler: Any) -> Any | None:
    """The rendezvous state the handler holds (torch's ``_RendezvousState``), or None."""
    holder = state_holder(handler)
    return None if holder is None else holder.state


def state_backend(handler: Any) -> Any | None:
    """The ``RendezvousBackend`` the handler's state holder reads and writes (benchmarks time
    it), or None when ``rdzv-state`` is off."""
    holder = state_holder(handler)
    return None if holder is None else getattr(holder, "_backend", None)


def state_cache(handler: Any) -> float | None:
    """How old a copy of the state the handler serves instead of reading it (torch: 1 s);
    None when ``rdzv-state`` is off."""
    holder = state_holder(handler)
    return None if holder is None else holder._cache_duration


def expire_state_cache(handler: Any) -> None:
    """Make the handler's next sync read the state, whatever its cache (any thread; nothing
    when ``rdzv-state`` is off)."""
    holder = state_holder(handler)
    if holder is not None:
        holder._last_sync_time = -1.0


def set_state_cache(handler: Any, seconds: float | None) -> None:
    """Set that age (nothing when ``rdzv-state`` is off or ``seconds`` is None)."""
    holder = state_holder(handler)
    if holder is not None and seconds is not None:
        holder._cache_duration = seconds


def heartbeat_lock(handler: Any) -> Any | None:
    """The lock torch holds while the handler reads or writes the state (keep-alives
    included), None when ``rdzv-fast-path`` is off."""
    return handler._heartbeat_lock if on("rdzv-fast-path") else None


def settings(handler: Any) -> Any:
    """The handler's ``RendezvousSettings`` (run_id, timeout, keep-alive interval and attempts)."""
    return handler._settings


def this_node(handler: Any) -> Any:
    return handler._this_node


def stop_heartbeats(handler: Any) -> None:
    """Stop the handler's keep-alive thread, as a node that died would (benchmarks)."""
    handler._stop_heartbeats()


def remove_participant_epilogue(state: Any, settings: Any) -> None:
    """What torch does after removing a participant (a new round when a group shrank)."""
    _REMOVE_EPILOGUE(state, settings)


def hook_handler(handler: Any, sanitize: Callable[[Callable[[], None]], None],
                 with_keep_alive: Callable[[Any], None]) -> Callable[[], None] | None:
    """At each sync of the handler's state, call ``sanitize(expire)`` where torch calls its
    expiry (``expire`` is torch's, to call from it), and ``with_keep_alive(state)`` after each
    keep-alive the handler writes. None (nothing hooked) when ``rdzv-fast-path`` is off;
    else the undo."""
    if not on("rdzv-fast-path"):
        return None
    holder, executor = handler._state_holder, handler._op_executor
    expire, keep_alive = holder._sanitize, executor._keep_alive

    def ours() -> None:
        sanitize(expire)

    def keep_alive_and_more() -> None:
        keep_alive()
        with_keep_alive(executor._state)

    holder._sanitize, executor._keep_alive = ours, keep_alive_and_more

    def undo() -> None:
        del holder._sanitize, executor._keep_alive  # the class's methods again

    return undo


def hook_operations(handler: Any, **after: Callable[[Any], None]) -> Callable[[], None] | None:
    """After torch's join operation NAME (``add_to_participants``, ``mark_rendezvous_complete``,
    ``add_to_redundancy_list``) runs in the handler's executor, call ``after[NAME](state)``.
    None (nothing hooked) when ``rdzv-early-close`` is off; else the undo."""
    if not on("rdzv-early-close"):
        return None
    executor = handler._op_executor
    names = [f"_{name}" for name in after]
    for name, then in zip(names, after.values(), strict=True):
        executor.__dict__[name] = _then(getattr(executor, name), then, executor)

    def undo() -> None:
        for name in names:
            executor.__dict__.pop(name, None)

    return undo


def guard_join(handler: Any, instead: Callable[[Any], str | None]) -> Callable[[], None] | None:
    """Before torch's ``_add_to_participants`` runs in the handler's executor, ask
    ``instead(state)``: the name of another join operation to run in its place
    (``add_to_redundancy_list``), or None for torch's own. None (nothing hooked) when
    ``rdzv-early-close`` is off; else the undo."""
    if not on("rdzv-early-close"):
        return None
    executor = handler._op_executor
    add = executor._add_to_participants  # with any ``hook_operations`` wrapper

    def guarded() -> None:
        other = instead(executor._state)
        if other:
            getattr(executor, f"_{other}")()
        else:
            add()

    executor.__dict__["_add_to_participants"] = guarded

    def undo() -> None:
        executor.__dict__.pop("_add_to_participants", None)

    return undo


def guard_vacancy(handler: Any, instead: Callable[[Any], str]) -> Callable[[], None] | None:
    """In place of torch's ``_remove_from_redundancy_list`` (a hot spare that found a free
    place: torch drops it from the list and its keep-alive, and joins in its next write), run
    the join operation ``instead(state)`` names (``add_to_wait_list``, ``add_to_participants``
    with any ``guard_join``, ``add_to_redundancy_list``), off the redundancy list unless that:
    the spare is listed somewhere in every write. None (nothing hooked) when
    ``rdzv-early-close`` is off; else the undo."""
    if not on("rdzv-early-close"):
        return None
    executor = handler._op_executor

    def moved() -> None:
        state = executor._state
        other = instead(state)
        if other != "add_to_redundancy_list":
            state.redundancy_list.discard(handler._this_node)
        getattr(executor, f"_{other}")()

    executor.__dict__["_remove_from_redundancy_list"] = moved

    def undo() -> None:
        executor.__dict__.pop("_remove_from_redundancy_list", None)

    return undo


def mark_complete(handler: Any) -> None:
    """torch's ``_mark_rendezvous_complete`` on the handler's executor (ranks assigned, the
    round complete; any ``hook_operations`` wrapper runs): from inside a join operation."""
    handler._op_executor._mark_rendezvous_complete()


def _then(operation: Callable[[], None], then: Callable[[Any], None], executor: Any) -> Callable[[], None]:
    def wrapped() -> None:
        operation()
        then(executor._state)
    return wrapped


def matches_this_host(host: str) -> bool:
    """Does ``host`` name this machine? torch's guess where ``rdzv-host-guess`` is on."""
    if on("rdzv-host-guess"):
        return bool(_MATCHES_HOST(host))
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    return host.startswith("127.") or host == "::1"
