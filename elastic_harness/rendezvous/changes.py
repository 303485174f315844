"""Word that the rendezvous state changed, pushed through the c10d store instead of polled.

torch's agents learn of a change to the rendezvous state by reading it again: a waiting
agent every second (``rendezvous.handler``: ``POLL_S``, ``rejoin_poll``), a running one every
time its monitor loop asks ``num_nodes_waiting`` (``poll_for``). After a node loss, each
survivor learnt that a peer's group failed, and later that the next round was complete, up
to one poll after the write that said so; at 8 nodes the last survivor saw the round broken
90 ms after the first, and the completed round 15-45 ms after it was written. ``ChangeSignal``
makes each such write wake every agent instead:

- a writer, after a state write that changes the rendezvous (a join, a leave, a completed
  or broken round), counts it (``n``: one more than the count in the key ``COUNTER``, by
  compare-and-set) and sets the key ``COUNTER.n`` (``announce``);
- each agent runs one thread, on a store client of its own, that waits for the next key
  (``store.wait``; the store answers the moment the key is set) and then tells everyone
  interested in this process: ``wait_beyond`` returns in the joining thread, and each
  ``listen`` callback runs (the agent's monitor loop ends its wait; ``HarnessAgent.nudge``).

Who reads also reads the version first (``version``, a number in memory): a change counted
after that is waited for, none is missed between a read and the wait that follows it. A
wait whose key never comes (a write from an agent without a signal, a write not counted) ends
at its poll, as before.

Which writes count: each count wakes every agent, so a round in which each of N agents
counts its own write would cost N^2 wake-ups (millions at 1000 nodes), and a key per
keep-alive (every ``keep_alive_interval`` from every node) would pile up in the store. The
writer asks first (``SealedC10dBackend.worth_announcing``, the handler's: does the write
change what another agent acts on? ``rendezvous.rules.shape``): a keep-alive, a join or a
leave, one more node on a wait list that has one, are not counted; the round broken,
reopened, completed or closed, the first node waiting, a spare more or less are. A round
after a node loss then costs a handful of counts, whatever N.
The keys of counted writes stay in the store (a few per round; nothing is read from them,
so nothing is trusted: a process that forges one wakes the agents for one read of the
sealed state).

A count that is not ours: the count is kept sealed (``Counts``: the number, a
nonce and an HMAC under the job's key), read and replaced by compare-and-set, never with the
store's ``add``: the store parses the value an ``add`` finds as a number in its own thread,
and a value that is not one (``b'\xff\x00garbage'``, 23 nines) made it log "Error processing
client message: stoll" and drop the connection of every agent that counted, which then took
its store host for lost (exit 200). A forged or garbled count is refused (one log line,
rate-limited like the state's) and rewritten from the newest count the agent knows; its
waiters may miss one wake-up and read at their next poll.

Carriers: a c10d TCP store (``ChangeSignal``: ``connect`` opens the thread's own client) and
etcd's v3 API (``rendezvous.etcd_v3.EtcdChanges``: the counted write puts a change key in its
own transaction, and the thread watches that key); etcd-v2 and a file store keep their
polls. Backends of either kind share ``Announcing`` (the per-thread version, the join's
wait). One thread per agent, started at its first use, ended by ``close``
or when the store goes away (then every wait is a plain sleep again). Its wait lasts
``WAIT_S``: torch's store client logs two lines at each timeout, so the wait never times
out in practice, and ``close`` ends it by announcing one change (every agent reads the
state once more). A process must not end with the thread inside the store's wait: one that
hosts the store then aborts ("terminate called without an active exception"), and a thread
whose store went away logs a C++ trace. So the agent closes its signal once its workers
succeeded, before torch's exit barrier lets the store's host go (``agent.elastic``), its
handler's ``shutdown`` closes it, and whatever is left open is closed at the interpreter's
exit (``close_all``, each within ``RELEASE_S``).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from elastic_harness import jobkey

log = logging.getLogger(__name__)

# How long the thread's one wait lasts before it asks again. torch's store client logs two
# lines when a wait times out; a day between them keeps the agents' logs clean.
WAIT_S = 86400.0
RELEASE_S = 1.0  # how long ``close`` waits for the thread to leave its wait
COUNT_ATTEMPTS = 8  # compare-and-sets an announcement tries before leaving the others to their polls
READY_S = 5.0  # how long a first reader waits for the thread to learn the count it starts from

_OPEN: weakref.WeakSet[PushedChanges] = weakref.WeakSet()


class PushedChanges:
    """Word of each change to one rendezvous state, pushed to this process by a thread (module
    doc): the version, the waits and the listeners, whatever carries the word. A carrier
    implements ``_follow`` (in the thread: ``_begin(n)`` once it knows the version to start
    from, ``_changed(n)`` at each change; returning or raising ends the word) and
    ``_release`` (unblock ``_follow`` for ``close``)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._version = 0
        self._listeners: list[Callable[[], None]] = []
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()  # the thread knows the count: no change is missed from then on
        self._stopped = False
        self.failed: str | None = None  # why the thread ended, when it did

    # ----- readers ---------------------------------------------------------------------
    @property
    def version(self) -> int:
        """Changes seen so far (starts the thread): read it before reading the state."""
        self._start()
        return self._version

    def wait_beyond(self, seen: int, timeout: float) -> bool:
        """Block until a change after ``seen`` (a ``version``) or ``timeout`` s; whether one
        came. A signal whose thread ended sleeps the whole ``timeout``."""
        self._start()
        deadline = time.monotonic() + timeout
        with self._cond:
            if self._cond.wait_for(lambda: self._version > seen or self._stopped, timeout) and self._version > seen:
                return True
        left = deadline - time.monotonic()
        if left > 0:  # the thread ended: the caller's poll, as without a signal
            time.sleep(left)
        return False

    def listen(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (on the signal's thread: keep it short) after each change."""
        with self._cond:
            self._listeners.append(callback)
        self._start()

    def close(self) -> None:
        """Stop waking anyone and end the thread (``_release``, waited for at most
        ``RELEASE_S``); safe to call twice."""
        with self._cond:
            if self._stopped:
                return
            self._stopped = True
            self._cond.notify_all()
            thread = self._thread
        if thread is None or not thread.is_alive():
            return
        self._release()
        thread.join(RELEASE_S)

    # ----- the thread ------------------------------------------------------------------
    def _start(self) -> None:
        """Start the thread (once) and wait until it knows the current count, so that a
        change announced after a caller's first ``version`` is one it waits for."""
        with self._cond:
            if self._thread is not None or self._stopped:
                thread = None
            else:
                thread = self._thread = threading.Thread(target=self._run, name="rendezvous-changes", daemon=True)
                _OPEN.add(self)
        if thread is not None:
            thread.start()
        self._ready.wait(READY_S)

    def _run(self) -> None:
        try:
            self._follow()
        except Exception as e:  # noqa: BLE001 - the carrier went away (the job's end): polls again
            self.failed = f"{type(e).__name__}: {e}"
            log.debug("rendezvous change signal stopped: %s", self.failed)
        finally:
            self._ready.set()
            with self._cond:
                self._stopped = True
                self._cond.notify_all()

    def _follow(self) -> None:
        raise NotImplementedError

    def _release(self) -> None:
        raise NotImplementedError

    def _begin(self, n: int) -> None:
        with self._cond:
            self._version = n
        self._ready.set()

    def _changed(self, n: int) -> None:
        with self._cond:
            self._version = n
            self._cond.notify_all()
            listeners = list(self._listeners)
        for callback in listeners:
            try:
                callback()
            except Exception:  # noqa: BLE001 - one listener's fault is not the others'
                log.exception("a rendezvous change listener failed")


class Counts:
    """The change count's stored form (module doc: "A count that is not ours"): ``N.NONCE.TAG``,
    TAG an HMAC under the job's key of the count and a nonce of this write (two agents that
    count the same N write different values, so a compare-and-set tells their writes
    apart). ``open`` is None for anything else: a forgery, garbage, a bare number."""

    def __init__(self, key: bytes, run_key: str) -> None:
        self._key, self._context = key, b"rendezvous-changes:" + run_key.encode()

    def close(self, n: int) -> bytes:
        body = b"%d.%s" % (n, secrets.token_hex(4).encode())
        return body + b"." + jobkey.sign_hex(self._key, body, self._context).encode()

    def open(self, value: Any) -> int | None:
        """The count in ``value``, or None when this job did not write it (never raises)."""
        body, _, tag = bytes(value).rpartition(b".")
        count = body.split(b".", 1)[0]
        if not (count.isdigit() and len(count) <= 18) or not jobkey.check_hex(self._key, body, tag.decode("latin-1"),
                                                                              self._context):
            return None
        return int(count)


class ChangeSignal(PushedChanges):
    """The change count of one rendezvous state (``key``) in a c10d store (module doc).

    ``store``: the agent's own store client (writes); ``connect()``: a new client to the same
    store, for the waiting thread (a wait blocks its client); ``job_key``: the job's key
    (``Counts``); ``warn(kind, message)``: how a refused count is logged (rate-limited by
    the caller: ``sealed.StateSeal.warn``)."""

    def __init__(self, store: Any, key: str, connect: Callable[[], Any], job_key: bytes,
                 warn: Callable[[str, str], None] | None = None) -> None:
        super().__init__()
        self._store, self._counter, self._connect = store, f"{key}.changes", connect
        self._counts = Counts(job_key, key)
        self._warn = warn or (lambda _kind, message: log.warning(message))

    def route_calls(self, wrap: Callable[[Any], Any]) -> None:
        """Make every store call go through ``wrap(client)``: the writer's, and the thread's
        when it connects after this (``bench rendezvous-scale`` counts them)."""
        connect = self._connect
        self._store = wrap(self._store)
        self._connect = lambda: wrap(connect())

    def announce(self) -> None:
        """Count a state write that changed the rendezvous and wake every waiting agent.
        Never raises: a store that cannot take the count leaves the others to their polls."""
        try:
            n = self._count_one()
            if n is not None:
                self._store.set(f"{self._counter}.{n}", b"")
        except (RuntimeError, ValueError, TimeoutError) as e:
            log.debug("could not announce a rendezvous change: %s", e)

    def _count_one(self) -> int | None:
        """The count plus one, by compare-and-set (never the store's ``add``, which parses
        whatever the key holds: module doc); a count this job did not write is rewritten
        from the newest count this agent knows. None: others kept winning the race."""
        for _ in range(COUNT_ATTEMPTS):
            current = self._read(self._store)
            n = self._counts.open(current)
            if n is None:
                self._refused(current)
                n = self._version
            desired = self._counts.close(n + 1)
            if self._store.compare_set(self._counter, current, desired) == desired:
                return n + 1
        return None

    def _read(self, client: Any) -> bytes:
        """The counter's stored value, created (count 0) if missing; never blocks."""
        return client.compare_set(self._counter, "", self._counts.close(0))

    def _refused(self, value: bytes) -> None:
        self._warn("changes", f"refused the rendezvous change count in the store key '{self._counter}' "
                   f"({len(value)} bytes, not written by this job); rewriting it")

    def _follow(self) -> None:
        client = self._connect()
        n = self._counts.open(self._read(client))
        self._begin(n or 0)
        n = n or 0
        while not self._stopped:
            with contextlib.suppress(TimeoutError):
                self._wait(client, f"{self._counter}.{n + 1}")
                n = max(n + 1, self._counts.open(self._read(client)) or 0)
                self._changed(n)

    def _release(self) -> None:
        """One change announced: the thread's wait ends (module doc)."""
        release = threading.Thread(target=self.announce, name="rendezvous-changes-release", daemon=True)
        release.start()  # a store that cannot be reached keeps the announcing thread, not the caller
        release.join(RELEASE_S)

    @staticmethod
    def _wait(client: Any, key: str) -> None:
        try:
            client.wait([key], timedelta(seconds=WAIT_S))
        except RuntimeError as e:  # torch's DistStoreError for a timeout, and for a lost store
            if "timeout" in str(e).lower():
                raise TimeoutError(str(e)) from None
            raise


class Announcing:
    """A rendezvous backend whose changes may be pushed (mixin): ``changes`` (a
    ``PushedChanges``, or None where nothing pushes), ``worth_announcing`` (set by the
    handler: is the write under way one to announce?), and the join's wait for a change
    after this thread's last read or write of the state."""

    changes: PushedChanges | None = None

    def _init_announcing(self, changes: PushedChanges | None) -> None:
        self.changes = changes
        # Without the handler's judgement (a torch without ``rdzv-state``) nobody listens,
        # and nothing is announced.
        self.worth_announcing: Callable[[], bool] = lambda: False
        self._seen = threading.local()  # per thread: the version before its last read or write

    def wait_for_change(self, timeout: float) -> bool | None:
        """Block until the state changes after this thread last read or wrote it, or for
        ``timeout`` s; whether it changed. None at once without a signal: the caller waits
        its own way."""
        if self.changes is None:
            return None
        return self.changes.wait_beyond(getattr(self._seen, "version", 0), timeout)

    def _note_version(self) -> None:
        """Call before each read or write of the state."""
        if self.changes is not None:
            self._seen.version = self.changes.version


@atexit.register
def close_all() -> None:
    """Close every signal whose thread runs (module doc)."""
    for signal in list(_OPEN):
        signal.close()

