"""Who owns a run directory or checkpoint directory: a lock file that names its holder.

The holder is a *job submission*, identified by its rendezvous id: every agent of one job
(and the ``run`` that started them) shares the lock; a different job is refused with a line
naming the holder. A rendezvous id can be pinned (``rendezvous.id``, ``--job-id``), so two
submissions may carry the same one: a launcher that knows its submission (``run`` makes a
fresh ``submission`` token and hands it to the agents it starts) joins only a lock of that
submission, and a live holder of another is refused whatever the id. A process that knows
no submission (an agent a scheduler started, a worker) joins by rendezvous id, as before.
The lock is a small JSON file at the directory's root
(``.elastic-harness.lock``) holding job name, rendezvous id, host, pid, start time and a
heartbeat time.

Safe for a crashed holder: on the holder's own host, a holder whose pid is gone (or was
reused by another process) is stale at once; from another host, a holder whose heartbeat is
older than ``STALE_S`` (60 s; the holder rewrites it every ``BEAT_S``, 10 s) is stale. A
stale lock is taken over, never waited on. Heartbeats compare wall clocks of different
hosts: they must agree to well within ``STALE_S - BEAT_S``.

Call order: ``Lease.acquire`` (raises ``LockHeld``), then ``release()`` on a clean exit
(safe to call twice). While held, a thread renews the heartbeat; a process of the same job
that finds the owner gone takes the lock over for the job.

Lost: a submission that stopped answering (frozen, cut off) looks gone, and
another job may take its lock over. When it comes back, its heartbeat (or ``check``, which
an agent calls before each worker generation it starts) finds the other live job holding
it: ``lost`` names that job, for good. The submission must stop without saving (the agent
kills its workers and starts no more: ``agent.elastic``), and so never starts a worker
generation that would bump the fence and shut the lock's holder out.

Limits: creating the file is atomic on local and shared filesystems (``link``); taking over
a stale lock, and anything on object stores (``s3://``), is last-writer-wins followed by a
read-back, so two contenders within the same instant can both proceed. The generation
fence (``fence``) then keeps the older one from committing checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from elastic_harness import runfiles

LOCK_FILE = runfiles.LOCK
BEAT_S = 10.0
STALE_S = 60.0


class RootFiles(Protocol):
    """The part of ``storage.Storage`` a lock needs."""

    root: str

    def read_root(self, filename: str) -> bytes: ...

    def write_root(self, filename: str, data: bytes) -> None: ...

    def create_root(self, filename: str, data: bytes) -> bool: ...

    def remove_root(self, filename: str) -> None: ...


@dataclass(frozen=True)
class Holder:
    job: str
    rdzv_id: str
    host: str
    pid: int
    pid_start: str  # the pid's start time in clock ticks since boot: tells pid reuse apart
    started: float
    token: str  # unique per holding process
    submission: str = ""  # unique per submission, shared by its launcher and agents ("" unknown)

    @classmethod
    def this_process(cls, job: str, rdzv_id: str, clock: Callable[[], float] = time.time, *,
                     submission: str = "") -> Holder:
        pid = os.getpid()
        return cls(job, rdzv_id, socket.gethostname(), pid, process_start(pid), clock(), uuid.uuid4().hex,
                   submission)

    def record(self, beat: float) -> dict:
        return {**asdict(self), "beat": beat}


class LockHeld(Exception):
    """Another live job holds the lock; ``record`` names it."""

    def __init__(self, record: dict) -> None:
        super().__init__(describe(record))
        self.record = record


def describe(record: dict) -> str:
    """One phrase naming a holder, for error lines."""
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.get("started", 0)))
    return (f"job '{record.get('job', '?')}' (rendezvous id {record.get('rdzv_id', '?')}, pid "
            f"{record.get('pid', '?')} on host {record.get('host', '?')}, since {since})")


def process_start(pid: int) -> str:
    """Start time of ``pid`` from /proc ("" if unknown): a reused pid has another one."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def pid_alive(record: dict) -> bool:
    """On this host: is the recorded process still the one running under that pid?"""
    pid = int(record.get("pid", 0))
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    want = record.get("pid_start", "")
    return (not want or process_start(pid) in ("", want)) and not _zombie(pid)


def _zombie(pid: int) -> bool:
    """An exited process its parent has not reaped yet: it holds nothing any more."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


# ----- pure decisions ------------------------------------------------------------------------
def staleness(record: dict, now: float, host: str, alive: Callable[[dict], bool], stale_s: float) -> str:
    """Pure: why ``record``'s holder is gone ("" while it looks alive)."""
    if record.get("host") == host:
        return "" if alive(record) else f"pid {record.get('pid')} is no longer running on {host}"
    age = now - float(record.get("beat", 0))
    return f"no heartbeat for {age:.0f} s (limit {stale_s:.0f} s)" if age > stale_s else ""


@dataclass(frozen=True)
class Decision:
    action: str  # "take" (no lock), "join" (same job), "takeover" (stale), "refuse"
    reason: str = ""


def decide(record: dict | None, me: Holder, now: float, alive: Callable[[dict], bool],
           stale_s: float = STALE_S) -> Decision:
    """Pure: what a would-be holder ``me`` does about the lock ``record`` it read."""
    if record is None:
        return Decision("take")
    if not isinstance(record, dict) or "rdzv_id" not in record:
        return Decision("takeover", "the lock file is unreadable")
    gone = staleness(record, now, me.host, alive, stale_s)
    theirs = str(record.get("submission") or "")
    other_submission = bool(theirs and me.submission and theirs != me.submission)
    if record["rdzv_id"] == me.rdzv_id and not other_submission:
        return Decision("takeover", gone) if gone and record.get("token") != me.token else Decision("join")
    return Decision("takeover", gone) if gone else Decision("refuse")


# ----- the lease -------------------------------------------------------------------------------
def read_record(store: RootFiles, filename: str = LOCK_FILE) -> dict | None:
    """The lock's record; None if there is none; ``{}`` if it cannot be parsed."""
    try:
        data = store.read_root(filename)
    except FileNotFoundError:
        return None
    try:
        record = json.loads(data)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


@dataclass(frozen=True)
class LeaseSettings:
    """How a lease is kept: its file, the heartbeat's period, the age after which another
    host's record is stale, the clock, and whether a record's process on this host lives."""

    filename: str = LOCK_FILE
    beat_s: float = BEAT_S
    stale_s: float = STALE_S
    clock: Callable[[], float] = time.time
    alive: Callable[[dict], bool] = pid_alive


class Lease:
    """A lock held (as its owner) or shared (``joined``) by this process."""

    def __init__(self, store: RootFiles, me: Holder, settings: LeaseSettings = LeaseSettings(), *,
                 owner: bool, took_over: str = "") -> None:
        self.store, self.me, self.owner, self.took_over = store, me, owner, took_over
        self.filename, self.beat_s, self.stale_s = settings.filename, settings.beat_s, settings.stale_s
        self._clock, self._alive = settings.clock, settings.alive
        self.lost: dict | None = None  # set by the heartbeat when another job holds it now
        self._stop = threading.Event()
        self._beating = threading.Lock()  # ``check`` and the heartbeat thread read and write one file
        self._thread = threading.Thread(target=self._beat_loop, name="lock-heartbeat", daemon=True)

    @classmethod
    def acquire(cls, store: RootFiles, me: Holder, **kw: Any) -> Lease:
        """Take, join or take over the lock; raise ``LockHeld`` naming a live other holder.
        ``kw``: the fields of ``LeaseSettings``."""
        settings = LeaseSettings(**kw)
        clock, alive, filename, stale_s = settings.clock, settings.alive, settings.filename, settings.stale_s
        for _ in range(3):  # a lost race re-reads and decides again
            record = read_record(store, filename)
            d = decide(record, me, clock(), alive, stale_s)
            if d.action == "refuse":
                raise LockHeld(record or {})
            if d.action == "join":
                lease = cls(store, me, settings, owner=record.get("token") == me.token)
                return lease._start()
            data = json.dumps(me.record(clock())).encode()
            if d.action == "take" and not store.create_root(filename, data):
                continue
            if d.action == "takeover":
                store.write_root(filename, data)
            if (read_record(store, filename) or {}).get("token") == me.token:
                return cls(store, me, settings, owner=True,
                           took_over=d.reason and describe(record or {}) + ": " + d.reason)._start()
        raise LockHeld(read_record(store, filename) or {})

    def _start(self) -> Lease:
        self._thread.start()
        return self

    def check(self) -> dict | None:
        """Read the lock now (one heartbeat): the record of the live job that took it over
        from this submission, else None. Once lost, lost for good: this submission stops."""
        if self.lost is None:
            with contextlib.suppress(OSError):  # storage hiccup: the heartbeat tries again
                self.beat()
        return self.lost

    def beat(self) -> None:
        """One heartbeat: renew our record, or take over for our job from a gone owner."""
        with self._beating:
            self._beat()

    def _beat(self) -> None:
        record = read_record(self.store, self.filename)
        if record and record.get("token") == self.me.token:
            self.owner = True
            self.store.write_root(self.filename, json.dumps(self.me.record(self._clock())).encode())
            return
        d = decide(record, self.me, self._clock(), self._alive, self.stale_s)
        if d.action == "refuse":
            self.lost = record
            return
        if d.action in ("take", "takeover"):  # "join": another process of this job owns it
            self.store.write_root(self.filename, json.dumps(self.me.record(self._clock())).encode())
            self.owner = True

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.beat_s) and self.lost is None:
            try:
                self.beat()
            except OSError:
                continue  # storage hiccup: the next beat tries again

    def release(self) -> None:
        """Stop the heartbeat; remove the lock if this process still owns it. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.beat_s + 5)
        try:
            if (read_record(self.store, self.filename) or {}).get("token") == self.me.token:
                self.store.remove_root(self.filename)
        except OSError:
            pass  # a lock left behind is stale once this process has exited
