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
joining, so a short grace suffices; a lost peer is no longer waited for once it is known
gone: dropped by ``liveness``/``verdict`` or seen expiring at a read of the state.

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
The backends here are ours, on torch's public ``RendezvousBackend`` interface, with the
state sealed under the job's key (``rendezvous.sealed``): a forged or corrupt value is refused before torch unpickles it, with
one logged line, and the job carries on with the last authentic state.

A dead node sooner (issue 26): an agent whose workers failed because a peer's connection
closed tells its handler (``peer_lost``); at each sync of the state the handler then drops
the peers of its last round that are certainly gone (``rendezvous.liveness``: same host and
the agent's process is gone, or another host and silent two keep-alive intervals), as
torch's own expiry would, and no longer waits for them as peers (``RoundTimeout.forget``).
Each agent writes its process identity next to its keep-alive (a ``lives`` entry in the
state, which is sealed like the rest). Never on silence alone: see ``liveness``. Limits: it hooks
private methods of torch's dynamic rendezvous, the state holder's ``_sanitize`` (run after
every sync, where torch's own expiry happens), the executor's ``_keep_alive`` and the join
operations a later round closes early on (``torchcompat.rdzv``: where a torch lacks them,
torch's expiry alone drops a lost node and a round waits its last call).

Call order: ``handler_for(params)`` once per agent (torch's registry, which calls
``create_handler``); the agent then uses the handler as torch's own.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
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
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)

from elastic_harness import jobkey
from elastic_harness.rendezvous import etcd_v3, liveness, probe, rounds, verdict
from elastic_harness.spec import backends
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

# Seconds between a running agent's reads of the state: how late it sees that a peer's group
# failed (``_Handler.round_broken``: it then stops its own workers at once). Without that, the
# failure reaches a worker through its collectives, one worker's exit after another (50-150 ms
# a hop); at 0.25 s the last survivor of an 8-node group still saw it 0.17 s after the first
# (issue 36, item 2). One read costs an agent well under a millisecond.
RUNNING_POLL_S = 0.1

# Store reads per second a job's running agents make together at most (issue 36: each read is
# the whole state, ~260 bytes a node; at 1000 nodes and ``POLL_S`` that was 4000 reads and ~1 GB
# a second on the one store). A group of more than ``STATE_READS_PER_S * RUNNING_POLL_S`` nodes
# reads the state less often (``poll_for``): a waiting node or a broken round is seen that much later.
STATE_READS_PER_S = 200.0
SPARE_POLL_S = 0.05  # a hot spare's reads of the state while it waits (``_Handler._wait_as_spare``)


def poll_for(nodes: int) -> float:
    """Pure: seconds between a running agent's reads of the state in a group of ``nodes``."""
    return max(RUNNING_POLL_S, nodes / STATE_READS_PER_S)


# Reads of the state a job's agents make together at most when woken by a change
# (``rendezvous.changes``): every counted write wakes every agent at once, and each then reads
# the whole state (260 KB at 1000 nodes). An agent woken within ``wake_gap`` of its last
# read reads when that gap is over: 8 ms at 8 nodes, a second at 1000.
WAKE_READS_PER_S = 1000.0


def wake_gap(nodes: int) -> float:
    """Pure: the least seconds between an agent's reads of the state that a change woke."""
    return nodes / WAKE_READS_PER_S


REJOIN_POLL_S = 0.05  # an agent rejoining after a restart: its peers arrive within moments


def rejoin_poll(nodes: int) -> float:
    """Pure: seconds between a rejoining agent's reads of the state (a round after a failure
    lasts a fraction of a second; the same cap on a job's reads as ``poll_for``, times 4)."""
    return max(REJOIN_POLL_S, nodes / (4 * STATE_READS_PER_S))


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
        missing = len((self._peers - set(state.participants)) | rounds.still_expected(
            members=getattr(state, "members", ()), gone=getattr(state, "gone", ()), participants=state.participants))
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


def _expiry_s(handler: Any) -> float:
    """Seconds after which the peers of ``handler``'s node take it for dead when its
    keep-alives stop (torch's rule)."""
    settings = rdzv.settings(handler)
    return settings.keep_alive_interval.total_seconds() * settings.keep_alive_max_attempt


def _backend(params: RendezvousParameters, name: str, key: bytes) -> tuple[Any, Any]:
    """Our state backend and store for backend ``name`` (c10d, etcd-v3, etcd-v2), the state
    sealed under ``key`` and a c10d store bound to one address (``rendezvous.sealed``)."""
    from elastic_harness.rendezvous import sealed

    in_store = backends.BY_TORCH_NAME[name].hosts_store  # where the state lives, for the log
    where = f"torch.rendezvous.{params.run_id}" if in_store else f"/torch/elastic/rendezvous/{params.run_id}"
    seal = sealed.StateSeal(key, params.run_id, where=where)
    return creators()[name](params, seal)


def creators() -> dict[str, Callable[[RendezvousParameters, Any], tuple[Any, Any]]]:
    """Each backend's state backend and store (torch's name: ``spec/backends.py``'s rows), the
    state sealed: the one place in the rendezvous a new backend is named."""
    from elastic_harness.rendezvous import sealed

    return {"c10d": sealed.create_c10d_backend, "etcd-v3": etcd_v3.create_backend,
            "etcd-v2": sealed.create_etcd_backend}


class _Handler(DynamicRendezvousHandler):
    """torch's handler; after each round it tells its ``RoundTimeout`` who was in it, and
    it drops peers of that round that are certainly gone once told ``peer_lost``."""

    _formed = False  # a rendezvous of this handler completed: later joins are restarts
    _round: int | None = None  # the round it completed last
    _peers: frozenset = frozenset()  # who was in that round
    _evidence = False  # since then, its workers failed because a peer's connection was lost
    _identity = ""  # ``liveness.identity()`` of this agent, written next to its keep-alives
    _ask: Any = None  # ``probe.Asker``: peers' beacons, asked when judging them
    _condemned: frozenset = frozenset()  # peers of its last round ``rendezvous.verdict`` found gone
    _failed = False  # its workers failed since its last round completed (``group_failed``)
    _steady_poll: float | None = None  # its state holder's cache outside a join (``POLL_S``; ``poll_for`` once formed)
    _read_at: datetime | None = None  # when it last read the state (wall clock, as keep-alives)
    _gaps: Any = None  # ``verdict.KeepAliveGaps`` of every node, from each read of the state
    _unreadable_since: float | None = None  # monotonic time its reads of the state began failing
    _synced_at = 0.0  # monotonic time it last read (or wrote) the state
    _synced_shape: tuple | None = None  # ``shape`` of the state it last read or wrote

    def peer_lost(self) -> None:
        """The agent's workers failed because a peer's connection closed (``liveness``);
        the agent's main thread calls it before it restarts the group."""
        self._evidence = True

    def group_failed(self) -> None:
        """The agent's workers failed (any cause; main thread, before it restarts them): the
        round is written broken with this agent's next change of the state, so that every
        peer stops its workers at once instead of waiting for the failure to reach them
        through their collectives, peer by peer (``round_broken``)."""
        self._failed = True

    def round_broken(self) -> bool:
        """Is this agent's last round over while its workers may still run in it? A peer
        wrote it broken (its group failed), or the round moved on (everyone else left, or
        this node was dropped). From the last read of the state (the agent reads it every
        ``POLL_S`` while its workers run); never before a round completed."""
        state = rdzv.state(self)
        return state is not None and self._round is not None and (
            state.round != self._round or getattr(state, "broken", None) == self._round)

    def was_dropped(self) -> bool:
        """Is this agent no longer a participant of the round it joined last (its peers
        dropped it, or torch's expiry did), by the last read of the state?"""
        state = rdzv.state(self)
        return state is not None and self._round is not None and rdzv.this_node(self) not in state.participants

    def num_nodes_waiting(self) -> int:
        """torch's, asked by the agent every monitor interval while its workers run; a
        rendezvous store that cannot be read for now (an etcd member lost, its cluster
        electing a leader) is not a reason to end a healthy group. torch's agent would let
        the error end this agent, and with it close the rendezvous for every node. So it
        counts as no node waiting, with one warning, until the store has been unreadable for
        as long as the peers take to expire this node (``keep_alive_interval *
        keep_alive_max_attempt``): then the error goes up as before."""
        try:
            waiting = super().num_nodes_waiting()
        except RendezvousConnectionError as e:
            now = time.monotonic()
            if self._unreadable_since is None:
                self._unreadable_since = now
                log.warning("Cannot read the rendezvous state (%s); the workers go on while it "
                            "recovers, for up to %.0f s", e, _expiry_s(self))
            if now - self._unreadable_since > _expiry_s(self):
                raise
            return 0
        if self._unreadable_since is not None:
            log.warning("The rendezvous state can be read again after %.1f s",
                        time.monotonic() - self._unreadable_since)
            self._unreadable_since = None
        return waiting

    def wait_for_change(self, timeout: float) -> None:
        """The join's poll (``delay``): until the state changes after this thread's last read
        of it, or ``timeout`` s (``rendezvous.changes``: c10d and etcd v3; else a sleep); after a
        change, the next sync reads the state instead of serving its cache."""
        backend = rdzv.state_backend(self)
        waiter = getattr(backend, "wait_for_change", None)
        deadline = time.monotonic() + timeout
        changed = waiter(timeout) if waiter is not None else None
        if changed is None:  # no signal to wait on (etcd-v2, a file store): torch's sleep
            TORCH_DELAY(timeout)
            return
        if changed:
            early = min(self._read_due(), deadline) - time.monotonic()
            if early > 0:  # the job's read budget (``wake_gap``)
                time.sleep(early)
            rdzv.expire_state_cache(self)

    def on_change(self, callback: Callable[[], None]) -> bool:
        """Call ``callback()`` (on another thread) after each counted change of the state
        (``rendezvous.changes``); the caller then reads it with ``refresh``. False where the
        backend pushes no changes (etcd-v2, a file store)."""
        changes = getattr(rdzv.state_backend(self), "changes", None)
        if changes is None:
            return False
        changes.listen(callback)
        return True

    def worth_announcing(self) -> bool:
        """Does the write under way change what another agent acts on (``shape``)? The
        backend counts only those (``rendezvous.changes``): a keep-alive, a join or a leave,
        another node added to a wait list that has one, are not; the first node waiting, a
        round broken, reopened, completed or closed, a spare more or less are."""
        state = rdzv.state(self)
        return state is None or shape(state) != self._synced_shape

    def _read_due(self) -> float:
        """When this agent may read the state again after a change woke it (``wake_gap``
        after its last read, for the agents the state lists)."""
        state = rdzv.state(self)
        nodes = 1 if state is None else len(state.participants) + len(state.wait_list) + len(state.redundancy_list)
        return self._synced_at + wake_gap(nodes)

    def stop_changes(self) -> None:
        """This agent needs no more word of changes (its workers are done): its signal's
        thread ends (``rendezvous.changes``: before the store's host may go)."""
        changes = getattr(rdzv.state_backend(self), "changes", None)
        if changes is not None:
            changes.close()

    def shutdown(self) -> bool:
        try:
            return super().shutdown()
        finally:
            self.stop_changes()

    def refresh(self) -> None:
        """Read the state (a change was heard): once this agent's read is due (``wake_gap``
        after its last one, which may have come just before the change). What
        ``round_broken`` and ``was_dropped`` then say is current."""
        lock, holder = rdzv.heartbeat_lock(self), rdzv.state_holder(self)
        if lock is None or holder is None:
            return
        early = self._read_due() - time.monotonic()
        if early > 0:
            time.sleep(early)
        rdzv.expire_state_cache(self)
        try:
            with lock:
                holder.sync()
        except RendezvousConnectionError:
            pass  # ``num_nodes_waiting``, next in torch's loop, says how long that may last

    def next_rendezvous(self) -> Any:
        _JOIN.restart = self._formed  # read by ``delay``, on this thread, inside this call
        _JOIN.wait = self.wait_for_change
        if self._steady_poll is None:
            self._steady_poll = rdzv.state_cache(self)  # ``POLL_S`` (``create_handler``), or a caller's
        if self._formed:  # a restart: the peers rejoin within moments; see them at once
            _JOIN.poll = rejoin_poll(len(self._peers))
            rdzv.set_state_cache(self, _JOIN.poll)
        try:
            info = super().next_rendezvous()
        finally:
            _JOIN.restart, _JOIN.poll, _JOIN.wait = False, POLL_S, None
            rdzv.set_state_cache(self, self._steady_poll)
        self._formed = True
        state = rdzv.state(self)
        if state is None:  # ``rdzv-state`` off: torch's own timeouts, no per-round memory
            return info
        rdzv.set_state_cache(self, poll_for(len(state.participants)))  # a large group reads less often
        self._round, self._peers, self._evidence = state.round, frozenset(state.participants), False
        self._condemned, self._failed = frozenset(), False
        timeout = rdzv.settings(self).timeout
        if isinstance(timeout, RoundTimeout):
            timeout.remember(state.participants)
        return info

    def drop_dead(self, state: Any) -> frozenset:
        """Remove from ``state`` (this agent's copy, just synced) the peers ``liveness``
        finds certainly gone, as torch's expiry removes a node; returns them."""
        if (self._failed or self._evidence or self._condemned) and state.round == self._round and state.complete:
            state.broken = self._round  # written with this agent's exit from the round (``group_failed``)
        lives = _lives(state)
        for node in [n for n in lives if n not in state.last_heartbeats]:
            del lives[node]  # left or expired: its entry goes with its keep-alive
        settings = rdzv.settings(self)
        dead = liveness.dead_peers(
            participants=state.participants, heartbeats=state.last_heartbeats, complete=state.complete,
            round_=state.round, my_round=self._round, peers=self._peers, me=rdzv.this_node(self),
            evidence=self._evidence or bool(self._condemned),
            gone=lambda node: node in self._condemned or liveness.gone(lives.get(node), ask=self._ask),
            now=datetime.now(timezone.utc),
            suspect_after=liveness.suspect_after_s(settings.keep_alive_interval.total_seconds(),
                                                   settings.keep_alive_max_attempt))
        for node in dead:
            how = ("its keep-alives and beacon silent while this node's workers stalled (rendezvous.verdict)"
                   if node in self._condemned
                   else "its agent's process is gone, and this node's workers lost their connection to a peer"
                   if liveness.gone(lives.get(node), ask=self._ask)
                   else "silent, and this node's workers lost their connection to a peer")
            message = (f"Dropping node '{node}' from round {state.round} of the rendezvous '{settings.run_id}' "
                       f"without waiting for its keep-alives to expire: {how}")
            log.warning(message)
            record_event(
                name="_Handler.drop_dead", run_id=settings.run_id, message=message,
                node_state=NodeState.RUNNING)
            for table in (state.last_heartbeats, state.participants, lives):
                table.pop(node, None)
            _nodes(state, "gone").add(node)
            state.wait_list.discard(node)
            state.redundancy_list.discard(node)
        if dead:
            rdzv.remove_participant_epilogue(state, settings)
            if isinstance(settings.timeout, RoundTimeout):
                settings.timeout.forget(dead)
        return dead

    def install_liveness(self) -> Callable[[], None] | None:
        """Hook ``drop_dead`` after torch's expiry at each sync of the state, and write this
        agent's identity (and its beacon's address: ``rendezvous.probe``) with each of its
        keep-alives; returns the undo (None: ``rdzv-fast-path`` is off on this torch, and
        torch's expiry alone drops a lost node)."""
        if not rdzv.on("rdzv-fast-path"):
            return None
        me = rdzv.this_node(self)
        self._identity = liveness.identity(_beacon(me.addr))
        self._ask = probe.Asker()
        self._gaps = verdict.KeepAliveGaps()

        def write_identity(state: Any) -> None:
            _lives(state)[me] = self._identity

        undo = rdzv.hook_handler(self, self._sanitize_and_judge, write_identity)
        self._close_rounds_early()
        return undo

    def _sanitize_and_judge(self, expire: Callable[[], None]) -> None:
        """At each sync of the state: torch's expiry (``expire``), then ours (``drop_dead``)."""
        self._synced_at = time.monotonic()
        self._read_at = now = datetime.now(timezone.utc)
        self._synced_shape = shape(rdzv.state(self))
        state = rdzv.state(self)
        beats = state.last_heartbeats
        self._gaps.observe(beats)
        settings = rdzv.settings(self)
        expiry = now - settings.keep_alive_interval * settings.keep_alive_max_attempt
        expired = [node for node, beat in beats.items() if beat < expiry]
        expire()  # torch drops those; not peers to wait for either (``RoundTimeout.forget``)
        if expired:
            _nodes(state, "gone").update(expired)
            if isinstance(settings.timeout, RoundTimeout):
                settings.timeout.forget(expired)
        self.drop_dead(state)

    def _close_rounds_early(self) -> None:
        """A later round closes once everyone expected joined it (``rendezvous.rounds``): each
        join checks, and each completed round records its members for the next one."""
        settings = rdzv.settings(self)

        def after_add(state: Any) -> None:
            if state.complete:
                return
            self._admit_waiting(state)
            if not state.complete and len(state.participants) >= settings.min_nodes and rounds.everyone_in(
                    round_=state.round, members=_nodes(state, "members"), gone=_nodes(state, "gone"),
                    participants=state.participants, waiting=state.wait_list, spares=state.redundancy_list,
                    max_nodes=settings.max_nodes):
                state.deadline = datetime.now(timezone.utc)

        def after_complete(state: Any) -> None:
            state.members, state.gone = set(state.participants), set()
            for node in rounds.stay_spares(participants=state.participants, waiting=state.wait_list,
                                           max_nodes=settings.max_nodes):
                if node in state.last_heartbeats:  # torch's own spares keep alive: a spare without one is none
                    state.wait_list.discard(node)
                    state.redundancy_list.add(node)

        rdzv.hook_operations(self, add_to_participants=after_add, mark_rendezvous_complete=after_complete)
        rdzv.guard_join(self, self._join_as)
        self._wait_as_spare()

    def _join_as(self, state: Any) -> str | None:
        """What this agent's join of an open round does instead of adding it (``rounds.join_as``):
        waiting as a spare, off the wait list (torch's own ``add_to_redundancy_list`` leaves it
        there: a node on both lists was admitted as a participant it then never joined as, or
        lost its keep-alive leaving one list while another agent moved it to the other)."""
        me, settings = rdzv.this_node(self), rdzv.settings(self)
        instead = rounds.join_as(node=me, participants=state.participants, max_nodes=settings.max_nodes,
                                 members=_nodes(state, "members"), gone=_nodes(state, "gone"))
        if instead:
            state.wait_list.discard(me)
        return instead

    def _admit_waiting(self, state: Any) -> None:
        """Add every agent of the wait list to the open round with this one (``rounds``:
        joining all at once), with torch's bookkeeping of an add: the last call starts when
        ``nodes.min`` are in, the round is complete at once when ``nodes.max`` are."""
        settings = rdzv.settings(self)
        before = len(state.participants)
        for node in rounds.admitted(participants=state.participants, waiting=state.wait_list,
                                    max_nodes=settings.max_nodes, members=_nodes(state, "members"),
                                    gone=_nodes(state, "gone")):
            state.wait_list.discard(node)
            state.redundancy_list.discard(node)  # one list at a time (``_join_as``)
            state.participants[node] = 0
        if len(state.participants) == before:
            return
        if before < settings.min_nodes <= len(state.participants):
            state.deadline = datetime.now(timezone.utc) + settings.timeout.last_call
        if rounds.full(state.participants, settings.max_nodes):
            rdzv.mark_complete(self)  # in this write: no one else's join can overfill it

    def _wait_as_spare(self) -> None:
        """A hot spare (torch's redundancy list: the round is full) reads the state every
        ``SPARE_POLL_S`` instead of ``POLL_S``: it takes a lost node's place as soon as
        the round has room (issue 36; a few spares, a few reads more a second)."""

        def after_spare(state: Any) -> None:
            _JOIN.poll = SPARE_POLL_S  # this join's thread (``delay``)
            rdzv.set_state_cache(self, SPARE_POLL_S)

        rdzv.hook_operations(self, add_to_redundancy_list=after_spare)
        rdzv.guard_vacancy(self, self._take_vacancy)

    def _take_vacancy(self, state: Any) -> str:
        """The join operation a hot spare that found a free place runs in the write that takes
        it off the redundancy list (``rounds.vacancy_join``: never on no list at all)."""
        return rounds.vacancy_join(complete=state.complete, participants=state.participants,
                                   max_nodes=rdzv.settings(self).max_nodes)

    def condemn(self, nodes: Any) -> None:
        """``rendezvous.verdict`` found these peers of the last round gone (any thread): dropped
        at the next read of the state (``drop_dead``), as if their processes were gone."""
        self._condemned = self._condemned | frozenset(nodes)

    def peers_now(self, wait_s: float = 0.2) -> tuple[list, dict] | None:
        """The peers of the last completed round as the last read of the state saw them
        (``verdict.Peer``), and their beacons' addresses; None before any round or while the
        state is being read for longer than ``wait_s`` (any thread)."""
        lock = rdzv.heartbeat_lock(self)
        if self._round is None or self._gaps is None or lock is None or not lock.acquire(timeout=wait_s):
            return None
        try:
            state, read_at, settings = rdzv.state(self), self._read_at, rdzv.settings(self)
            interval = settings.keep_alive_interval.total_seconds()
            expiry = interval * settings.keep_alive_max_attempt
            ours = state.round == self._round and state.complete
            lives = _lives(state)
            peers = []
            for node in sorted(self._peers - {rdzv.this_node(self)}):
                beat = state.last_heartbeats.get(node)
                silent = (read_at - beat).total_seconds() if beat is not None and read_at is not None else None
                bound = verdict.silence_bound_s(interval, self._gaps.usual(node), expiry)
                peers.append(verdict.Peer(node, ours and node in state.participants, silent, bound))
            beacons = {n: lives[n].partition("|")[2] for n in self._peers if "|" in lives.get(n, "")}
            return peers, beacons
        finally:
            lock.release()


_BEACONS: list = []  # this process's beacon (one agent per process), open until ``close_beacon``


def _beacon(addr: str) -> str:
    """The address of this agent's beacon on ``addr`` (started once), or "" if it cannot
    listen there (then peers on other hosts wait for its keep-alives, as before)."""
    if not _BEACONS:
        try:
            _BEACONS.append(probe.Beacon(addr).start())
        except OSError as e:
            log.warning("no liveness beacon on %s (%s): peers on other hosts will wait for this "
                        "node's keep-alives to expire if it dies", addr, e)
            return ""
    return _BEACONS[0].address


def close_beacon() -> None:
    """Close this process's beacon and end its thread; peers on other hosts then find its
    agent gone, and the next handler made here starts another. An agent's process needs no
    call (its exit closes the beacon); a process that made handlers and lives on does (a
    test's: every later fork of it would inherit the thread's state)."""
    while _BEACONS:
        _BEACONS.pop().close()


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


def _nodes(state: Any, name: str) -> set:
    """A set of nodes our rules keep in the state (``members``, ``gone``: ``rendezvous.rounds``),
    made if missing; it rides in torch's pickled state object like ``lives``."""
    nodes = getattr(state, name, None)
    if nodes is None:
        nodes = set()
        setattr(state, name, nodes)
    return nodes


def shape(state: Any) -> tuple | None:
    """Pure: what of the rendezvous state other agents act on (``_Handler.worth_announcing``):
    the round, whether it is complete, closed or broken, whether anyone waits, the spares.
    Not the participants: a join or a leave concerns the others only through one of those
    (the round closing, or opening once everyone left); a round's last call is checked at
    each poll, as before."""
    if state is None:
        return None
    return (state.round, state.complete, state.closed, getattr(state, "broken", None), bool(state.wait_list),
            len(state.redundancy_list))


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
    seconds = min(seconds, getattr(_JOIN, "poll", POLL_S))
    wait = getattr(_JOIN, "wait", None)  # the joining handler's: woken by a change (``rendezvous.changes``)
    if wait is None:
        TORCH_DELAY(seconds)
        return
    wait(seconds)


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
# stay torch's; ``etcd-v3`` (``rendezvous.etcd_v3``) has no torch namesake.
REGISTERED = {b.torch_name: b.registered for b in backends.BACKENDS}  # spec/backends.py


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
    c10d, etcd-v3 (``rendezvous.etcd_v3``) and etcd-v2 backends (``REGISTERED``'s names too), its
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
    if holder is not None and hasattr(backend, "worth_announcing"):
        backend.worth_announcing = handler.worth_announcing  # counted changes only (``rendezvous.changes``)
    return handler


def torch_timeout(params: RendezvousParameters) -> RendezvousTimeout:
    """torch's own timeouts, for a torch whose rendezvous state cannot be read
    (``rdzv-state`` off): every round waits the start last call, the safe one at start-up."""
    return RendezvousTimeout(join=timedelta(seconds=_seconds(params, "join_timeout")),
                             last_call=timedelta(seconds=float(params.get(
                                 "start_last_call_timeout", _seconds(params, "last_call_timeout")))),
                             close=timedelta(seconds=_seconds(params, "close_timeout")),
                             heartbeat=timedelta(seconds=_seconds(params, "heartbeat_timeout")))
