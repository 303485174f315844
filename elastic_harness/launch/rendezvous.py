"""torch's dynamic rendezvous (c10d, etcd-v3, etcd-v2) with a last call decided per round.

torch's ``DynamicRendezvousHandler`` closes a round ``last_call`` seconds after ``nodes.min``
nodes joined it (or at once when ``nodes.max`` did). One value serves two opposite needs:

- at start-up, agents start together but not at once (importing torch alone takes seconds,
  more on a loaded machine): a short last call lets the first agent form a group alone,
  and the others then force a membership change (the start-up race seen with 1 s);
- after a node loss, every surviving agent is already listed in the rendezvous state,
  waiting for the next round: a long last call only delays the restart.

So the last call is decided from the rendezvous state at the moment it is set
(``last_call_s``): round 0 of a submission (each submission has its own rendezvous id)
waits ``start_last_call`` for the rest; a later round waits ``last_call`` if other agents are
known to be waiting for it (torch's wait and redundancy lists); else ``PEER_GRACE_S`` if a
peer of this agent's previous round has not joined yet; else not at all (a node that
arrives later joins by a membership change).

Why the previous round's peers: after a worker crash every agent of the group restarts at
about the same moment. torch opens the next round only once every participant of the last
one left it (its exit), and an agent joins right after its exit, in the same call; so two
agents that both exit can each find the new round open and the other one not in it yet,
and the first would close a group of one. A peer that left is one store round trip from
joining, so a short grace suffices; a lost peer (removed once its keep-alives expired)
costs that grace once.

The deciding happens where torch reads the value: ``RoundTimeout.last_call`` is read only
when an agent's join brings a round to ``nodes.min`` (``_add_to_participants``), on the
executor's freshly synced state, which is the state holder's. ``create_handler`` builds
torch's handler exactly as torch's own c10d/etcd-v2 creators do, with that timeout.

Limits: the state is read through the handler's state holder (``torchcompat.rdzv``: where a
torch lacks it, every round waits the start last call); keep-alive expiry compares the
writer's and the reader's wall clocks, so clock skew between hosts adds to (or eats into)
``keep_alive_interval * keep_alive_max_attempt``.

Events without ``inspect.stack()``: every rendezvous operation records an event (the report
reads them, through ``bridge``), named after the method and file that recorded it, which
torch finds with ``inspect.stack()`` twice per event. That reads the source of every frame
and searches ``sys.modules`` for each: 20-30 ms per event with torch loaded, 100-150 ms of
each restart's rendezvous on a 2-core machine, most of the time it took. torch skips it
only when nobody listens. ``create_handler`` replaces both lookups in torch's
``dynamic_rendezvous`` module with ``method_name`` and ``record_event``, which read the same
frames directly: the same events, in microseconds (``torchcompat.rdzv.patch_module``: only in
the agent's process, undone by tests).

No start-up skew at restarts: see ``delay``.

Authenticated state (issue 22): torch pickles the rendezvous state into the c10d store or
etcd, and unpickles whatever it reads back; both are writable by anyone who reaches them.
The backends here are torch's with the state sealed under the job's key
(``launch.sealed``): a forged or corrupt value is refused before torch unpickles it, with
one logged line, and the job carries on with the last authentic state.

A dead node sooner (issue 26): an agent whose workers failed because a peer's connection
closed tells its handler (``peer_lost``); at each sync of the state the handler then drops
the peers of its last round that are certainly gone (``launch.liveness``: same host and
the agent's process is gone, or another host and silent two keep-alive intervals), as
torch's own expiry would, and no longer waits for them as peers (``RoundTimeout.forget``).
Each agent writes its process identity next to its keep-alive (a ``lives`` entry in the
state, which is sealed like the rest). Never on silence alone: see ``liveness``. Limits: it hooks two
private methods of torch's dynamic rendezvous, the state holder's ``_sanitize`` (run after
every sync, where torch's own expiry happens) and the executor's ``_keep_alive``
(``torchcompat.rdzv.hook_handler``); where a torch lacks them, torch's expiry alone drops a
lost node.

Call order: ``handler_for(params)`` once per agent (torch's registry, which calls
``create_handler``); the agent then uses the handler as torch's own.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from torch.distributed.elastic.events import (
    NodeState,
    RdzvEvent,
    get_logging_handler,
    record_rdzv_event,
)
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)

from elastic_harness import jobkey
from elastic_harness.launch import etcd_v3, liveness
from elastic_harness.torchcompat import rdzv

log = logging.getLogger(__name__)

# Fallbacks when a key is missing from the rendezvous config (torch's own defaults).
_DEFAULTS = {"join_timeout": 600.0, "last_call_timeout": 30.0, "close_timeout": 30.0,
             "heartbeat_timeout": 5.0, "keep_alive_interval": 5.0, "keep_alive_max_attempt": 3}


# Seconds a later round waits for a peer of the previous round that has not joined it yet
# (see the module docstring); a store round trip, well within torch's own 1 s poll.
PEER_GRACE_S = 1.0

# Seconds between a waiting agent's reads of the rendezvous state (torch's SYNC action: 1 s),
# and the oldest copy of the state torch serves instead of reading it (its state holder's
# ``cache_duration``: 1 s), which is also how late a running agent, asking every
# ``timeouts.monitor_interval``, sees a node waiting to join. At torch's 1 s a join paid
# about a second three times over: the running agent noticing the joiner, then each of the
# two agents seeing the other in the new round (issue 26). One store read per agent per
# ``POLL_S`` while it waits or runs.
POLL_S = 0.25


def last_call_s(round_: int, others_waiting: int, peers_missing: int = 0, *, start_s: float,
                later_s: float) -> float:
    """Pure: seconds a round stays open for more agents once ``nodes.min`` have joined it.

    ``round_`` 0 is the start of a submission: ``start_s``. Later rounds: ``later_s`` while
    ``others_waiting`` agents (listed as waiting for this round, besides the one deciding)
    may still join, and at least two of their polls (``POLL_S``): a waiting agent reads
    the state once a poll, and the deciding agent checks its deadline on the same beat, so
    a deadline one poll away is a coin toss between "joined" and "closed without it" (seen:
    two agents restarting together split into two groups of one); else ``PEER_GRACE_S`` (at
    most ``later_s``) while ``peers_missing`` agents of the deciding agent's previous round
    have not joined; else 0: no agent is known to be coming, so close now.
    """
    if round_ == 0:
        return start_s
    if others_waiting > 0:
        return max(later_s, 2 * POLL_S)
    return min(later_s, PEER_GRACE_S) if peers_missing > 0 else 0.0


class RoundTimeout(RendezvousTimeout):
    """torch's rendezvous timeouts, with ``last_call`` decided per round by ``last_call_s``.

    ``follow(state)`` gives it the callable returning the handler's current rendezvous
    state; before that (or if it returns None) ``last_call`` is the configured value.
    """

    def __init__(self, *, join: float, start_last_call: float, last_call: float, close: float,
                 heartbeat: float) -> None:
        super().__init__(join=timedelta(seconds=join), last_call=timedelta(seconds=last_call),
                         close=timedelta(seconds=close), heartbeat=timedelta(seconds=heartbeat))
        if start_last_call <= 0:
            raise ValueError(f"start_last_call ({start_last_call}) must be positive")
        self.start_last_call = timedelta(seconds=start_last_call)
        self.later_last_call = timedelta(seconds=last_call)  # torch's copy is private to it
        self._state: Callable[[], Any] = lambda: None
        self._peers: frozenset = frozenset()  # the participants of this agent's last round

    def follow(self, state: Callable[[], Any]) -> None:
        self._state = state

    def remember(self, participants: Any) -> None:
        """The participants of the round this agent just completed (``_Handler``)."""
        self._peers = frozenset(participants)

    def forget(self, nodes: Any) -> None:
        """``nodes`` are certainly gone (``liveness``): not peers to wait for."""
        self._peers = self._peers - frozenset(nodes)

    @property
    def last_call(self) -> timedelta:
        state = self._state()
        if state is None:
            return self.later_last_call
        others = len(state.wait_list) + len(state.redundancy_list)
        missing = len(self._peers - set(state.participants))
        return timedelta(seconds=last_call_s(state.round, others, missing,
                                             start_s=self.start_last_call.total_seconds(),
                                             later_s=self.later_last_call.total_seconds()))


def timeout_from(params: RendezvousParameters) -> RoundTimeout:
    """The timeouts in a rendezvous config (``launch.config.rdzv_configs``), in seconds."""
    later = _seconds(params, "last_call_timeout")
    return RoundTimeout(join=_seconds(params, "join_timeout"),
                        start_last_call=float(params.get("start_last_call_timeout", later)),
                        last_call=later, close=_seconds(params, "close_timeout"),
                        heartbeat=_seconds(params, "heartbeat_timeout"))


def _seconds(params: RendezvousParameters, key: str) -> float:
    return float(params.get(key, _DEFAULTS[key]))


def _backend(params: RendezvousParameters, name: str, key: bytes) -> tuple[Any, Any]:
    """Our state backend and store for backend ``name`` (c10d, etcd-v3, etcd-v2), the state sealed
    under ``key`` and a c10d store bound to one address (``launch.sealed``)."""
    from elastic_harness.launch import sealed

    seal = sealed.StateSeal(key, params.run_id)
    if name == "c10d":
        return sealed.create_c10d_backend(params, seal)
    if name == etcd_v3.BACKEND:
        return etcd_v3.create_backend(params, seal)
    return sealed.create_etcd_backend(params, seal)


class _Handler(DynamicRendezvousHandler):
    """torch's handler; after each round it tells its ``RoundTimeout`` who was in it, and
    it drops peers of that round that are certainly gone once told ``peer_lost``."""

    _formed = False  # a rendezvous of this handler completed: later joins are restarts
    _round: int | None = None  # the round it completed last
    _peers: frozenset = frozenset()  # who was in that round
    _evidence = False  # since then, its workers failed because a peer's connection was lost
    _identity = ""  # ``liveness.identity()`` of this agent, written next to its keep-alives

    def peer_lost(self) -> None:
        """The agent's workers failed because a peer's connection closed (``liveness``);
        the agent's main thread calls it before it restarts the group."""
        self._evidence = True

    def next_rendezvous(self) -> Any:
        _JOIN.restart = self._formed  # read by ``delay``, on this thread, inside this call
        try:
            info = super().next_rendezvous()
        finally:
            _JOIN.restart = False
        self._formed = True
        state = rdzv.state(self)
        if state is None:  # ``rdzv-state`` off: torch's own timeouts, no per-round memory
            return info
        self._round, self._peers, self._evidence = state.round, frozenset(state.participants), False
        timeout = rdzv.settings(self).timeout
        if isinstance(timeout, RoundTimeout):
            timeout.remember(state.participants)
        return info

    def drop_dead(self, state: Any) -> frozenset:
        """Remove from ``state`` (this agent's copy, just synced) the peers ``liveness``
        finds certainly gone, as torch's expiry removes a node; returns them."""
        lives = _lives(state)
        for node in [n for n in lives if n not in state.last_heartbeats]:
            del lives[node]  # left or expired: its entry goes with its keep-alive
        settings = rdzv.settings(self)
        dead = liveness.dead_peers(
            participants=state.participants, heartbeats=state.last_heartbeats, complete=state.complete,
            round_=state.round, my_round=self._round, peers=self._peers, me=rdzv.this_node(self),
            evidence=self._evidence, gone=lambda node: liveness.gone(lives.get(node)),
            now=datetime.now(timezone.utc),
            suspect_after=liveness.suspect_after_s(settings.keep_alive_interval.total_seconds(),
                                                   settings.keep_alive_max_attempt))
        for node in dead:
            how = "its agent's process is gone" if liveness.gone(lives.get(node)) else "silent"
            message = (f"Dropping node '{node}' from round {state.round} of the rendezvous '{settings.run_id}' "
                       f"without waiting for its keep-alives to expire: {how}, and this node's workers "
                       "lost their connection to a peer")
            log.warning(message)
            record_event(
                name="_Handler.drop_dead", run_id=settings.run_id, message=message,
                node_state=NodeState.RUNNING)
            for table in (state.last_heartbeats, state.participants, lives):
                table.pop(node, None)
            state.wait_list.discard(node)
            state.redundancy_list.discard(node)
        if dead:
            rdzv.remove_participant_epilogue(state, settings)
            if isinstance(settings.timeout, RoundTimeout):
                settings.timeout.forget(dead)
        return dead

    def install_liveness(self) -> Callable[[], None] | None:
        """Hook ``drop_dead`` after torch's expiry at each sync of the state, and write this
        agent's identity with each of its keep-alives; returns the undo (None: torch's
        expiry alone, ``rdzv-fast-path`` is off on this torch)."""
        self._identity = liveness.identity()
        me = rdzv.this_node(self) if rdzv.on("rdzv-fast-path") else None

        def write_identity(state: Any) -> None:
            _lives(state)[me] = self._identity

        return rdzv.hook_handler(self, lambda state: self.drop_dead(state), write_identity)


def group_running(handler: Any) -> bool:
    """Does the rendezvous hold a formed group, so that this agent's join makes it drain?
    (A completed round with participants, read from the backend.) True when it cannot
    tell (another handler, or the read fails): the caller then waits as if it did."""
    holder = rdzv.state_holder(handler)
    if holder is None:
        return True
    try:
        holder.sync()
    except Exception:  # noqa: BLE001 - the join that follows reports the backend's trouble
        return True
    state = holder.state
    return bool(state.complete and state.participants)


def _lives(state: Any) -> dict:
    """The state's ``lives`` table (node -> ``liveness.identity()``), made if missing: it
    rides in torch's pickled state object, which our sealed backends carry whole."""
    lives = getattr(state, "lives", None)
    if lives is None:
        lives = state.lives = {}
    return lives


TORCH_METHOD_NAME = rdzv.TORCH_GET_METHOD_NAME  # torch's own, kept for comparison
TORCH_DELAY = rdzv.TORCH_DELAY
_JOIN = threading.local()  # ``restart``: the handler joining on this thread was in a group


def delay(seconds: float | tuple[float, float]) -> None:
    """torch's ``_delay``, less the random 0-0.3 s it sleeps before a join while the
    rendezvous state's round is 0, when the joining handler has been in a group. That skew is meant
    for agents starting together; but the round still reads 0 at the first restart (the next
    round opens only when an agent joins it), so every job paid it (0.15 s on average) on
    its first restart. The fixed one-second poll (a bare number, torch's only one) is
    ``POLL_S``."""
    if isinstance(seconds, tuple):
        if getattr(_JOIN, "restart", False):
            return
        TORCH_DELAY(seconds)
        return
    TORCH_DELAY(min(seconds, POLL_S))


def method_name(depth: int = 2) -> str:
    """What torch's ``dynamic_rendezvous.get_method_name`` returns (the name of the function
    ``depth`` frames up from this one), without building ``inspect.stack()``."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # the stack is not that deep
        return "no_method_name"


def record_event(run_id: str, message: str, node_state: NodeState, name: str = "", hostname: str = "",
                 pid: int | None = None, master_endpoint: str = "", local_id: int | None = None,
                 rank: int | None = None) -> None:
    """What torch's ``events.construct_and_record_rdzv_event`` records (same signature, same
    ``RdzvEvent``, through torch's ``record_rdzv_event``), with the caller read from its frame."""
    if isinstance(get_logging_handler("dynamic_rendezvous"), logging.NullHandler):
        return
    caller = sys._getframe(1)
    event = RdzvEvent(
        name=f"{os.path.basename(caller.f_code.co_filename)}:{name or caller.f_code.co_name}",
        run_id=run_id, message=message, hostname=hostname or socket.getfqdn(), pid=pid or os.getpid(),
        node_state=node_state, master_endpoint=master_endpoint, rank=rank, local_id=local_id,
        error_trace=traceback.format_exc() if node_state == NodeState.FAILED else "",
    )
    record_rdzv_event(event)


# Our handler in torch's rendezvous handler registry (its public extension point), under
# names of its own (each is also its backend's ``name``): torch's ``c10d`` and ``etcd-v2``
# stay torch's; ``etcd-v3`` (``launch.etcd_v3``) has no torch namesake.
REGISTERED = {"c10d": "harness-c10d", "etcd-v2": "harness-etcd-v2", etcd_v3.BACKEND: etcd_v3.BACKEND}


def register() -> None:
    """Put ``create_handler`` in torch's registry under ``REGISTERED``'s names (idempotent:
    torch's ``register`` accepts the same creator again)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    for name in REGISTERED.values():
        rendezvous_handler_registry.register(name, create_handler)


def handler_for(params: RendezvousParameters) -> RendezvousHandler:
    """The agent's handler, made by torch's registry: ours for c10d, etcd-v3 and etcd-v2
    (``register``), torch's own for any other backend."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    register()
    name = REGISTERED.get(params.backend, params.backend)
    ours = RendezvousParameters(backend=name, endpoint=params.endpoint, run_id=params.run_id,
                                min_nodes=params.min_nodes, max_nodes=params.max_nodes,
                                local_addr=params.local_addr, **params.config)
    return rendezvous_handler_registry.create_handler(ours)


def create_handler(params: RendezvousParameters, key: bytes | None = None) -> RendezvousHandler:
    """The agent's rendezvous handler: torch's dynamic one with ``RoundTimeout`` for the
    c10d, etcd-v3 (``launch.etcd_v3``) and etcd-v2 backends (``REGISTERED``'s names too), its
    state sealed with the job's ``key`` (else the key in the file that the config's
    ``key_file`` names: ``launch.config.rdzv_configs``); any other backend exactly as torch's
    registry makes it."""
    rdzv.patch_module(method_name, record_event, delay)  # see the module docstring
    register()  # a handler torch's registry makes for these names is this one, too
    backend_name = {v: k for k, v in REGISTERED.items()}.get(params.backend, params.backend)
    if backend_name not in REGISTERED:
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

        return get_rendezvous_handler(params)
    if key is None:
        if not params.get("key_file"):
            raise ValueError("the rendezvous needs the job's key (key_file in its config)")
        key = jobkey.read(Path(params.get("key_file")))
    backend, store = _backend(params, backend_name, key)
    timeout = timeout_from(params) if rdzv.on("rdzv-state") else torch_timeout(params)
    handler = _Handler.from_backend(
        params.run_id, store, backend, params.min_nodes, params.max_nodes, params.local_addr, timeout,
        keep_alive_interval=int(_seconds(params, "keep_alive_interval")),
        keep_alive_max_attempt=int(params.get("keep_alive_max_attempt", 3)),
    )
    holder = rdzv.state_holder(handler)  # the state torch's join operation is changing
    if holder is not None:
        rdzv.set_state_cache(handler, POLL_S)  # see ``POLL_S``
        timeout.follow(lambda: holder.state)
    handler.install_liveness()
    return handler


def torch_timeout(params: RendezvousParameters) -> RendezvousTimeout:
    """torch's own timeouts, for a torch whose rendezvous state cannot be read
    (``rdzv-state`` off): every round waits the start last call, the safe one at start-up."""
    return RendezvousTimeout(join=timedelta(seconds=_seconds(params, "join_timeout")),
                             last_call=timedelta(seconds=float(params.get(
                                 "start_last_call_timeout", _seconds(params, "last_call_timeout")))),
                             close=timedelta(seconds=_seconds(params, "close_timeout")),
                             heartbeat=timedelta(seconds=_seconds(params, "heartbeat_timeout")))
