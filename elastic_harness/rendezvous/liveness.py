"""Which peers of the last round are certainly gone: closing a round without waiting for a
lost node's keep-alives to expire.

torch's dynamic rendezvous drops a node when its last keep-alive is older than
``keep_alive_interval * keep_alive_max_attempt`` (3 s here). A shorter expiry alone is not
safe: at 2 s a live but busy agent on a loaded machine was declared dead while its group
was healthy, and a joining agent then formed a second group. So the rule here never acts
on silence alone. It needs, all at once:

1. **evidence from this agent's own group**: one of its workers failed because a peer's
   connection closed or was reset (``peer_lost``, on the failure message torchelastic read
   from the worker's error file). The group of the last round is broken then, whatever
   happens to the rendezvous; what is decided is only whether the next round waits for
   the silent node;
2. the node was a **peer of that round and is still listed in it** (the state's round is
   that round, complete, and the node is still a participant): an agent that is alive
   leaves the round (torch's exit) as soon as it sees its own workers fail, which they do
   when their peers' connections drop; a dead one never does;
3. and **certainty about the node itself**, either:
   - *same host*: the node's agent ran in this agent's boot and pid namespace (the
     ``lives`` entry each agent writes next to its keep-alive in the sealed state) and
     that process is gone (no such pid, a zombie, or a pid reused by a process started
     later). A SIGSTOPped or slow agent is a live process: never dropped by this rule;
   - *another host, its process gone*: the node's host refused a connection to its
     agent's beacon (``rendezvous.probe``: the host's kernel answers, nothing listens: the
     process died). Its ``lives`` entry names the beacon's address;
   - *another host, silent*: its last keep-alive is older than ``suspect_after_s`` (two
     keep-alive intervals, at most torch's expiry), and its beacon did not answer either
     (one that answers is alive: never dropped). Only here does an agent that is alive but
     stalled risk being dropped early; it then joins the next round as a late agent would
     (one membership change), since its group had already failed.

A node dropped by the rule is also no longer waited for as a peer of the previous round
(``rendezvous.rules.PEER_GRACE_S``). Everything else stays torch's: a node without evidence
against it expires as before.

Call order: ``identity(beacon)`` once per agent (its ``lives`` entry); ``peer_lost(message)``
on each failure of its group; ``dead_peers(...)`` at each sync of the state (pure), with
``gone(...)`` answering for a node (its process here, else its beacon).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from datetime import datetime
from typing import Any

# How a gloo (or TCP) collective says its peer's process is gone; lower case.
PEER_LOST_MARKS = ("connection closed by peer", "connection reset by peer", "broken pipe")


def peer_lost(message: Any) -> bool:
    """Pure: does a worker's failure message say a peer's connection closed or was reset?
    (A collective that timed out, a frozen peer, says nothing of the sort.)"""
    text = str(message).lower()
    return any(mark in text for mark in PEER_LOST_MARKS)


def suspect_after_s(keep_alive_s: float, max_attempt: int) -> float:
    """Pure: keep-alive age after which a listed node another agent has evidence against is
    dropped (two intervals, never later than torch's own expiry)."""
    return min(2 * keep_alive_s, keep_alive_s * max_attempt)


def dead_peers(state: Any, *, my_round: int | None, peers: Collection, me: Any, evidence: bool,
               gone: Callable[[Any], bool | None], stale: datetime) -> frozenset:
    """Pure: the peers of this agent's last round to drop now (module doc).

    ``state``: the rendezvous state as read (``participants``, ``last_heartbeats``,
    ``complete``, ``round``: a ``torchcompat.rdzv.StateView``); ``my_round``/``peers``: the
    round this agent completed last and who was in it; ``evidence``: its group failed with a
    peer's connection lost since; ``gone(node)``: True if the node's agent is certainly gone,
    False if certainly alive, None if it ran on another host (unknown); ``stale``: a node of
    another host silent since before then is suspect (``suspect_after_s`` ago)."""
    if not evidence or not state.complete or state.round != my_round:
        return frozenset()
    heartbeats = state.last_heartbeats
    dead = set()
    for node in set(peers) & set(state.participants) - {me}:
        verdict = gone(node)
        if verdict is True or (verdict is None and node in heartbeats and heartbeats[node] < stale):
            dead.add(node)
    return frozenset(dead)


def identity(beacon: str = "") -> str:
    """This process: ``boot/pid-namespace/pid/start``, then ``|HOST:PORT`` of its beacon
    (``rendezvous.probe``) if it has one; ``gone`` compares against it."""
    me = f"{_host()}/{os.getpid()}/{_start_ticks(os.getpid())}"
    return f"{me}|{beacon}" if beacon else me


def gone(recorded: str | None, here: str | None = None,
         ask: Callable[[str], str] | None = None) -> bool | None:
    """Is the process ``recorded`` (an ``identity()``) certainly gone (True), certainly alive
    (False)? On this host its pid answers; on another, its beacon, through ``ask(address)``
    (``probe.probe``: refused is gone, an answer alive). None when nothing can tell."""
    if not recorded:
        return None
    recorded, _, beacon = recorded.partition("|")
    mine = _gone_here(recorded, here)
    if mine is not None or not beacon or ask is None:
        return mine
    answer = ask(beacon)
    return True if answer == "gone" else False if answer == "alive" else None


def _gone_here(recorded: str, here: str | None) -> bool | None:
    """``gone`` for a process of this boot and pid namespace; None for any other."""
    parts = recorded.split("/")
    if len(parts) != 4 or "/".join(parts[:2]) != (here or _host()) or not parts[2].isdigit():
        return None
    pid, start = int(parts[2]), parts[3]
    if pid <= 0:
        return None
    now = _start_ticks(pid)
    return now is None or now != start


def _host() -> str:
    """Boot and pid namespace of this process: two agents with the same value see the same
    pids."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return "unknown-" + str(os.getpid())  # never equal to another process's
    return f"{boot}/{ns}"


def _start_ticks(pid: int) -> str | None:
    """The start time of ``pid`` (``/proc/PID/stat`` field 22); None if there is no such
    process, or it is a zombie (it has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]
