"""torch's dynamic rendezvous (c10d, etcd-v3, etcd-v2), its decisions ours: the handler.

``create_handler`` builds torch's ``DynamicRendezvousHandler`` as torch's own creators do,
on our sealed state backends (``rendezvous.sealed``, ``rendezvous.etcd_v3``), and ``_Handler``
applies, at torch's hook points (``torchcompat.rdzv``), what the pure rules of
``rendezvous.rules`` decide over a frozen view of torch's state, our own fields sealed beside
it and the evidence (``rendezvous.liveness``, ``rendezvous.verdict``): the last call of each
round, who is admitted, stays a spare or takes a vacancy, which peers are dropped as dead,
whether a round is broken, how a join polls. Why each rule is as it is, and its limits:
docs/how-it-works.md ("Rendezvous rounds" and after). Call order: ``handler_for(params)`` once
per agent (torch's registry, which calls ``create_handler``); the agent then uses the handler
as torch's own.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
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
from elastic_harness.rendezvous import etcd_v3, liveness, probe, rules, verdict
from elastic_harness.rendezvous.rules import (  # noqa: F401 - the rendezvous' settings, named here too
    PEER_GRACE_S,
    POLL_S,
    REJOIN_POLL_S,
    RUNNING_POLL_S,
    SPARE_POLL_S,
    STATE_READS_PER_S,
    WAKE_READS_PER_S,
    last_call_s,
    poll_for,
    rejoin_poll,
    wake_gap,
)
from elastic_harness.spec import backends
from elastic_harness.torchcompat import rdzv

log = logging.getLogger(__name__)

# Fallbacks when a key is missing from the rendezvous config (torch's own defaults).
_DEFAULTS = {"join_timeout": 600.0, "last_call_timeout": 30.0, "close_timeout": 30.0,
             "heartbeat_timeout": 5.0, "keep_alive_interval": 5.0, "keep_alive_max_attempt": 3}

# Why a node was dropped (``rules.Drop.why``), in the rendezvous' log line.
_WHY = {"condemned": "its keep-alives and beacon silent while this node's workers stalled (rendezvous.verdict)",
        "gone": "its agent's process is gone, and this node's workers lost their connection to a peer",
        "silent": "silent, and this node's workers lost their connection to a peer"}


class RoundTimeout(RendezvousTimeout):
    """torch's rendezvous timeouts, with ``last_call`` decided per round (``rules.last_call``).

    ``follow(state, ours)`` gives it the callables returning the handler's current view of
    torch's state and our fields beside it; before that (or if ``state`` returns None)
    ``last_call`` is the configured value.
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
        self._ours: Callable[[], rules.Ours] = rules.Ours
        self._peers: frozenset = frozenset()  # the participants of this agent's last round

    def follow(self, state: Callable[[], Any], ours: Callable[[], rules.Ours] = rules.Ours) -> None:
        self._state, self._ours = state, ours

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
        return timedelta(seconds=rules.last_call(state, self._ours(), self._peers,
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


def _backend(params: RendezvousParameters, name: str, key: bytes) -> tuple[Any, Any, Any]:
    """Our state backend, store and seal for backend ``name`` (c10d, etcd-v3, etcd-v2), the
    state sealed under ``key`` and a c10d store bound to one address (``rendezvous.sealed``)."""
    from elastic_harness.rendezvous import sealed

    in_store = backends.BY_TORCH_NAME[name].hosts_store  # where the state lives, for the log
    where = f"torch.rendezvous.{params.run_id}" if in_store else f"/torch/elastic/rendezvous/{params.run_id}"
    seal = sealed.StateSeal(key, params.run_id, where=where)
    return (*creators()[name](params, seal), seal)


def creators() -> dict[str, Callable[[RendezvousParameters, Any], tuple[Any, Any]]]:
    """Each backend's state backend and store (torch's name: ``spec/backends.py``'s rows), the
    state sealed: the one place in the rendezvous a new backend is named."""
    from elastic_harness.rendezvous import sealed

    return {"c10d": sealed.create_c10d_backend, "etcd-v3": etcd_v3.create_backend,
            "etcd-v2": sealed.create_etcd_backend}


@dataclass
class _Join:
    """What torch's delay (``delay``) asks of a handler's join; found through the handler's
    executor or the handler itself (``torchcompat.rdzv.pace_with``), never a thread-local."""

    pace: rules.Pace = rules.Pace()
    wait: Callable[[float], None] | None = None  # while it joins: its ``wait_for_change``
    steady: float | None = None  # its state holder's cache outside a join (``POLL_S``; ``poll_for`` once formed)


@dataclass
class _Reads:
    """This agent's reads of the state."""

    at: datetime | None = None  # when it last read the state (wall clock, as keep-alives)
    synced_at: float = 0.0  # monotonic time it last read (or wrote) the state
    shape: tuple | None = None  # ``rules.shape`` of the state it last read or wrote
    unreadable_since: float | None = None  # monotonic time its reads of the state began failing
    gaps: Any = None  # ``verdict.KeepAliveGaps`` of every node, from each read of the state


class _Handler(DynamicRendezvousHandler):
    """torch's handler, applying at torch's hook points what ``rules`` decide (module doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # torch's, as ``from_backend`` calls it
        self._seal: Any = None  # ``sealed.StateSeal``: our fields beside the state (``_ours``)
        self._mine = rules.Memory()  # this agent's rounds
        self._condemned: frozenset = frozenset()  # peers of its last round ``rendezvous.verdict`` found gone
        self._join, self._reads = _Join(), _Reads()
        self._identity, self._ask = "", None  # ``liveness.identity()`` written with its keep-alives; beacons asked
        rdzv.pace_with(self, self._join)

    def peer_lost(self) -> None:
        """The agent's workers failed because a peer's connection closed (``liveness``);
        the agent's main thread calls it before it restarts the group."""
        self._mine = replace(self._mine, evidence=True)

    def group_failed(self) -> None:
        """The agent's workers failed (any cause; main thread, before it restarts them): the
        round is written broken with this agent's next change of the state, so that every
        peer stops its workers at once instead of waiting for the failure to reach them
        through their collectives, peer by peer (``round_broken``)."""
        self._mine = replace(self._mine, failed=True)

    def round_broken(self) -> bool:
        """Is this agent's last round over while its workers may still run in it
        (``rules.round_broken``)? From the last read of the state (the agent reads it every
        ``RUNNING_POLL_S`` while its workers run); never before a round completed."""
        state = rdzv.state(self)
        return state is not None and rules.round_broken(rdzv.view(state), _ours(self), self._mine)

    def was_dropped(self) -> bool:
        """Is this agent no longer a participant of the round it joined last (its peers
        dropped it, or torch's expiry did), by the last read of the state, read again first
        when it is stale (``rules.judged_on_a_new_read``)?"""
        if rules.judged_on_a_new_read(time.monotonic() - self._reads.synced_at):
            self.refresh()
        state = rdzv.state(self)
        return (state is not None and self._mine.round is not None
                and rdzv.this_node(self) not in rdzv.view(state).participants)

    def num_nodes_waiting(self) -> int:
        """torch's, asked by the agent every monitor interval while its workers run; a
        rendezvous store that cannot be read for now (an etcd member lost, its cluster
        electing a leader) is not a reason to end a healthy group. torch's agent would let
        the error end this agent, and with it close the rendezvous for every node. So it
        counts as no node waiting, with one warning, until the store has been unreadable for
        as long as the peers take to expire this node (``keep_alive_interval *
        keep_alive_max_attempt``): then the error goes up as before."""
        reads = self._reads
        try:
            waiting = super().num_nodes_waiting()
        except RendezvousConnectionError as e:
            now = time.monotonic()
            if reads.unreadable_since is None:
                reads.unreadable_since = now
                log.warning("Cannot read the rendezvous state (%s); the workers go on while it "
                            "recovers, for up to %.0f s", e, _expiry_s(self))
            if now - reads.unreadable_since > _expiry_s(self):
                raise
            return 0
        if reads.unreadable_since is not None:
            log.warning("The rendezvous state can be read again after %.1f s",
                        time.monotonic() - reads.unreadable_since)
            reads.unreadable_since = None
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
            early = min(_read_due(self), deadline) - time.monotonic()
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
        """Does the write under way change what another agent acts on (``rules.shape``)? The
        backend counts only those (``rendezvous.changes``): a keep-alive, a join or a leave,
        another node added to a wait list that has one, are not; the first node waiting, a
        round broken, reopened, completed or closed, a spare more or less are."""
        state = rdzv.state(self)
        return state is None or rules.shape(rdzv.view(state), _ours(self)) != self._reads.shape

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
        early = _read_due(self) - time.monotonic()
        if early > 0:
            time.sleep(early)
        rdzv.expire_state_cache(self)
        try:
            with lock:
                holder.sync()
        except RendezvousConnectionError:
            pass  # ``num_nodes_waiting``, next in torch's loop, says how long that may last

    def next_rendezvous(self) -> Any:
        join, mine = self._join, self._mine
        if join.steady is None:
            join.steady = rdzv.state_cache(self)  # ``POLL_S`` (``create_handler``), or a caller's
        join.pace = rules.Pace(restart=mine.formed, poll=rejoin_poll(len(mine.peers)) if mine.formed else POLL_S)
        join.wait = self.wait_for_change
        if mine.formed:  # a restart: the peers rejoin within moments; see them at once
            rdzv.set_state_cache(self, join.pace.poll)
        try:
            info = super().next_rendezvous()
        finally:
            join.pace, join.wait = rules.Pace(), None
            rdzv.set_state_cache(self, join.steady)
        state = rdzv.state(self)
        if state is None:  # ``rdzv-state`` off: torch's own timeouts, no per-round memory
            self._mine = replace(self._mine, formed=True)
            return info
        view = rdzv.view(state)
        rdzv.set_state_cache(self, poll_for(len(view.participants)))  # a large group reads less often
        self._mine, self._condemned = rules.Memory(formed=True, round=view.round, peers=frozenset(view.participants)), frozenset()
        timeout = rdzv.settings(self).timeout
        if isinstance(timeout, RoundTimeout):
            timeout.remember(view.participants)
        return info

    def drop_dead(self, state: Any) -> frozenset:
        """Apply ``rules.on_sync`` to ``state`` (torch's, this agent's copy just synced): its
        round written broken if its group failed, and the peers ``liveness`` finds certainly
        gone removed as torch's expiry removes a node; returns them."""
        settings = rdzv.settings(self)
        stale = datetime.now(timezone.utc) - timedelta(seconds=liveness.suspect_after_s(
            settings.keep_alive_interval.total_seconds(), settings.keep_alive_max_attempt))
        view = rdzv.view(state)
        sync = rules.on_sync(view, _ours(self), self._mine, me=rdzv.this_node(self), condemned=self._condemned,
                             gone=lambda who: liveness.gone(who, ask=self._ask), stale=stale)
        _set_ours(self, sync.ours)
        for drop in sync.drops:
            message = (f"Dropping node '{drop.node}' from round {view.round} of the rendezvous '{settings.run_id}' "
                       f"without waiting for its keep-alives to expire: {_WHY[drop.why]}")
            log.warning(message)
            record_event(name="_Handler.drop_dead", run_id=settings.run_id, message=message,
                         node_state=NodeState.RUNNING)
            rdzv.drop(state, drop.node)
        dead = frozenset(drop.node for drop in sync.drops)
        if dead:
            rdzv.remove_participant_epilogue(state, settings)
            if isinstance(settings.timeout, RoundTimeout):
                settings.timeout.forget(dead)
        return dead

    def install_liveness(self) -> Callable[[], None] | None:
        """Hook ``_on_sync`` after torch's expiry at each sync of the state, write this agent's
        identity (and its beacon's address: ``rendezvous.probe``) with each of its keep-alives,
        and hook the joins (``_hook_joins``); returns the undo (None: ``rdzv-fast-path`` is off
        on this torch, and torch's expiry alone drops a lost node)."""
        if not rdzv.on("rdzv-fast-path"):
            return None
        me = rdzv.this_node(self)
        self._identity = liveness.identity(_beacon(me.addr))
        self._ask = probe.Asker()
        self._reads.gaps = verdict.KeepAliveGaps()

        def write_identity(state: Any) -> None:
            ours = _ours(self)
            _set_ours(self, replace(ours, lives={**ours.lives, me: self._identity}))

        undo = rdzv.hook_handler(self, self._on_sync, write_identity)
        self._hook_joins()
        return undo

    def _on_sync(self, expire: Callable[[], None]) -> None:
        """At each sync of the state: torch's expiry (``expire``), then ours (``drop_dead``)."""
        reads, state, settings = self._reads, rdzv.state(self), rdzv.settings(self)
        reads.synced_at, reads.at = time.monotonic(), datetime.now(timezone.utc)
        view = rdzv.view(state)
        reads.shape = rules.shape(view, _ours(self))
        reads.gaps.observe(view.last_heartbeats)
        expired = rules.expired(view, now=reads.at,
                                expiry=settings.keep_alive_interval * settings.keep_alive_max_attempt)
        expire()  # torch drops those; not peers to wait for either (``RoundTimeout.forget``)
        if expired:
            ours = _ours(self)
            _set_ours(self, replace(ours, gone=ours.gone | expired))
            if isinstance(settings.timeout, RoundTimeout):
                settings.timeout.forget(expired)
        self.drop_dead(state)

    def _hook_joins(self) -> None:
        """At torch's join operations (``torchcompat.rdzv``), what ``rules`` decide: admit the
        waiting agents, start or end the last call, complete a full round, keep spares spares,
        join as a spare instead, take a vacancy in one write; a spare polls faster."""
        settings, me = rdzv.settings(self), rdzv.this_node(self)

        def after_add(state: Any) -> None:
            act = rules.admission(rdzv.view(state), _ours(self), min_nodes=settings.min_nodes,
                                  max_nodes=settings.max_nodes)
            rdzv.admit(state, act.admit)
            if act.last_call_starts:
                rdzv.set_deadline(state, datetime.now(timezone.utc) + settings.timeout.last_call)
            if act.complete:  # in this write: no one else's join can overfill it, no second write
                rdzv.mark_complete(self)

        def after_complete(state: Any) -> None:
            done = rules.completion(rdzv.view(state), _ours(self), max_nodes=settings.max_nodes)
            _set_ours(self, done.ours)
            rdzv.make_spares(state, done.spares)

        def join_as(state: Any) -> str | None:
            instead = rules.join_as(rdzv.view(state), _ours(self), me=me, max_nodes=settings.max_nodes)
            if instead:  # off the wait list: a node on both lists lost its keep-alive to torch
                rdzv.off_wait_list(state, me)
            return instead

        def after_spare(state: Any) -> None:
            self._join.pace = replace(self._join.pace, poll=SPARE_POLL_S)  # this join's (``delay``)
            rdzv.set_state_cache(self, SPARE_POLL_S)

        rdzv.hook_operations(self, add_to_participants=after_add, mark_rendezvous_complete=after_complete)
        rdzv.guard_join(self, join_as)
        rdzv.hook_operations(self, add_to_redundancy_list=after_spare)
        rdzv.guard_vacancy(self, lambda state: rules.vacancy(rdzv.view(state), max_nodes=settings.max_nodes))

    def condemn(self, nodes: Any) -> None:
        """``rendezvous.verdict`` found these peers of the last round gone (any thread): dropped
        at the next read of the state (``drop_dead``), as if their processes were gone."""
        self._condemned = self._condemned | frozenset(nodes)

    def peers_now(self, wait_s: float = 0.2) -> tuple[list, dict] | None:
        """The peers of the last completed round as the last read of the state saw them
        (``verdict.Peer``), and their beacons' addresses; None before any round or while the
        state is being read for longer than ``wait_s`` (any thread)."""
        lock, mine, reads = rdzv.heartbeat_lock(self), self._mine, self._reads
        if mine.round is None or reads.gaps is None or lock is None or not lock.acquire(timeout=wait_s):
            return None
        try:
            view, settings, lives = rdzv.view(rdzv.state(self)), rdzv.settings(self), _ours(self).lives
            interval = settings.keep_alive_interval.total_seconds()
            expiry = interval * settings.keep_alive_max_attempt
            ours = view.round == mine.round and view.complete
            peers = []
            for node in sorted(mine.peers - {rdzv.this_node(self)}):
                beat = view.last_heartbeats.get(node)
                silent = (reads.at - beat).total_seconds() if beat is not None and reads.at is not None else None
                bound = verdict.silence_bound_s(interval, reads.gaps.usual(node), expiry)
                peers.append(verdict.Peer(node, ours and node in view.participants, silent, bound))
            beacons = {n: lives[n].partition("|")[2] for n in mine.peers if "|" in lives.get(n, "")}
            return peers, beacons
        finally:
            lock.release()


def _ours(handler: _Handler) -> rules.Ours:
    """Our fields beside the state the handler last read or wrote (its seal keeps them)."""
    seal = handler._seal
    beside = None if seal is None else seal.beside
    return beside if isinstance(beside, rules.Ours) else rules.Ours()


def _set_ours(handler: _Handler, ours: rules.Ours) -> None:
    """Our fields to write beside the state with the handler's next write."""
    if handler._seal is not None:
        handler._seal.beside = ours


def _read_due(handler: _Handler) -> float:
    """When the agent may read the state again after a change woke it (``wake_gap`` after its
    last read, for the agents the state lists)."""
    state = rdzv.state(handler)
    view = rdzv.view(state) if state is not None else None
    nodes = 1 if view is None else len(view.participants) + len(view.wait_list) + len(view.redundancy_list)
    return handler._reads.synced_at + wake_gap(nodes)


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
    view = rdzv.view(holder.state)
    return bool(view.complete and view.participants)


TORCH_METHOD_NAME = rdzv.TORCH_GET_METHOD_NAME  # torch's own, kept for comparison
TORCH_DELAY = rdzv.TORCH_DELAY


def delay(seconds: float | tuple[float, float]) -> None:
    """torch's ``_delay``, replaced: the join of the handler whose code calls it paces it
    (``rules.pause``: no random start-up skew on a restart, ``POLL_S`` polls at most, woken by
    a change of the state), found from torch's caller (``torchcompat.rdzv.caller_pace``);
    torch's own delay, its poll cut to ``POLL_S``, for any other caller."""
    join = rdzv.caller_pace() or _Join()
    wait = rules.pause(seconds, join.pace)
    if wait is None:
        return
    if isinstance(wait, tuple) or join.wait is None:
        TORCH_DELAY(wait)
        return
    join.wait(wait)


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
    rdzv.patch_module(method_name, record_event, delay)  # docs/how-it-works.md
    register()  # a handler torch's registry makes for these names is this one, too
    backend_name = {v: k for k, v in REGISTERED.items()}.get(params.backend, params.backend)
    if backend_name not in REGISTERED:
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

        return get_rendezvous_handler(params)
    if key is None:
        if not params.get("key_file"):
            raise ValueError("the rendezvous needs the job's key (key_file in its config)")
        key = jobkey.read(Path(params.get("key_file")))
    backend, store, seal = _backend(params, backend_name, key)
    timeout = timeout_from(params) if rdzv.on("rdzv-state") else torch_timeout(params)
    handler = _Handler.from_backend(
        params.run_id, store, backend, params.min_nodes, params.max_nodes, params.local_addr, timeout,
        keep_alive_interval=int(_seconds(params, "keep_alive_interval")),
        keep_alive_max_attempt=int(params.get("keep_alive_max_attempt", 3)),
    )
    handler._seal = seal  # our fields travel beside the state, sealed with it
    holder = rdzv.state_holder(handler)  # the state torch's join operation is changing
    if holder is not None:
        rdzv.set_state_cache(handler, POLL_S)  # see ``POLL_S``
        timeout.follow(lambda: rdzv.view(holder.state), lambda: _ours(handler))
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
