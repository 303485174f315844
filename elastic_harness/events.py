"""The run's event log: one JSON object per line in ``RUN_DIR/events.jsonl``.

Several processes append to the same file (the host CLI, each agent, rank 0 of each
worker generation). Each event is one ``write()`` of one line on a file opened with
``O_APPEND``, which POSIX makes atomic for local files, so lines never interleave.

``CONTRACT`` below is the documentation: every kind the code emits, who writes it, and
every field it may carry (each event also has ``COMMON``), and ``field_types`` the shape
readers accept for a field they compute with. A field may be absent (older runs, optional
values); no other field may appear: ``tests/report/test_event_contract.py`` scans every
``emit("kind", ...)`` call in the package and fails on an undocumented kind or field, or a
value whose shape the readers would refuse, and feeds an event of every kind to every reader.
Readers fold the log one way (``runstate``), and read it one way (``EventTail``): a line
that is not an event (not UTF-8, not JSON, not an object with ``t`` and ``event``, or a field
readers compute with of the wrong type: ``well_formed``) is skipped and counted, never
raised; ``skipped_notes`` says so once per log (the CLI prints it after any command).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class EventKind:
    writer: str  # which process writes it
    meaning: str
    fields: dict[str, str]  # name -> what it holds


COMMON = {
    "t": "unix seconds when it was written (the writer's clock)",
    "event": "the kind, a key of CONTRACT",
    "pid": "the writing process (rank 0's pid names a worker generation)",
}

_WORLD = "ranks in the current worker group"
CONTRACT: dict[str, EventKind] = {
    "start": EventKind("host (who=host), an agent (who=agent), or rank 0 of a script under plain "
                       "torchrun/python (who=script)", "an invocation or an agent started", {
        "who": "'host', 'agent' or 'script'",
        "nodes": "host: agents started (Slurm: the 'MIN:MAX' nodes asked for); agent: 'MIN:MAX' nodes",
        "nproc_per_node": "workers per node",
        "run_id": "rendezvous id of this submission",
        "run_dir": "host: the run directory",
        "netns": "host: nodes run in their own network namespaces (link faults possible)",
        "separate_hosts": "host: each node is a simulated host of its own (own pid, UTS and network "
                          "namespaces: pids in its events are its own)",
        "scheduler": "host: where it was submitted when not started by `run` ('slurm')",
        "node": "agent: its node name",
        "endpoint": "agent: the rendezvous endpoint",
        "launcher": "bench: the launcher compared against (e.g. 'torchrun')",
    }),
    "worker": EventKind("every rank, after its process group formed", "a worker process started", {
        "rank": "global rank",
        "local_rank": "rank on its node",
        "group_rank": "its node's rank in the group",
        "node": "node name",
        "restart": "torchelastic's restart count of its agent",
        "world_size": _WORLD,
    }),
    "rendezvous": EventKind("rank 0", "a worker generation formed", {
        "generation": "id shared by the generation's ranks",
        "world_size": _WORLD,
        "restart": "torchelastic's restart count of rank 0's agent",
        "nodes": "nodes in the group",
        "pg_init_s": "seconds to initialise the process group",
    }),
    "resume": EventKind("rank 0", "state restored, or fresh: true when no checkpoint was found", {
        "fresh": "true when starting from scratch",
        "step": "step of the checkpoint loaded (0 when fresh)",
        "source": "'memory' (every rank from its own agent's in-memory snapshot), 'peer' (some ranks "
                  "received the in-memory snapshot from a peer over the network: DDP), 'buddy' (FSDP: every old "
                  "rank's snapshot, its own or a buddy copy kept by another node, resharded in memory to "
                  "this world size) or 'storage' (a DCP checkpoint)",
        "checkpoint": "name of the checkpoint loaded (storage)",
        "saved_world_size": "world size that saved it",
        "world_size": _WORLD,
        "load_s": "seconds to load it",
        "samples": "samples consumed so far (the data cursor)",
        "message": "one line for the terminal",
        "senders": "memory/peer/buddy: the ranks that sent a snapshot to ranks without it",
        "phases_s": "memory/peer: rank 0's seconds per phase of the restore (offers, layout, transfer, load, keep)",
        "receivers": "memory/peer: how many ranks received it from a peer; buddy: how many snapshots "
                     "moved between ranks",
    }),
    "step": EventKind("rank 0, every train.log_every steps and the last", "optimizer steps done", {
        "step": "optimizer steps completed",
        "loss": "mean loss of the step",
        "world_size": _WORLD,
        "samples": "samples consumed so far",
        "restart": "torchelastic's restart count of rank 0's agent",
        "step_s": "seconds the step took",
        "samples_per_s": "global batch / step_s",
        "lr": "learning rate of the first parameter group for this update (None if unknown)",
        "metrics": "step.done()'s metrics, {name: float} (the task path: grad_norm), or None",
    }),
    "eval": EventKind("rank 0", "an evaluation ran", {
        "step": "step evaluated",
        "metrics": "{name: float}",
        "eval_s": "seconds it took",
    }),
    "checkpoint": EventKind("rank 0 (async: its background thread)", "a checkpoint was committed", {
        "step": "step saved",
        "path": "where it lives (path or URL)",
        "blocking_s": "seconds training was blocked: the save's call until it returned (async: "
                      "the copy), a wait for the save before it included",
        "waited_s": "of blocking_s, the wait for the save before it to finish (at most one is in flight)",
        "total_s": "seconds from the save's call until committed",
        "asynchronous": "written in the background",
    }),
    "memory": EventKind("rank 0", "the in-memory tier's snapshot interval was set or changed "
                        "(checkpoint.memory_every, memory_budget)", {
        "step": "the step from which it applies",
        "every": "snapshot every this many steps (and at every durable save); 0: off (a memory_probe block)",
        "copy_s": "median seconds a snapshot took on rank 0 (0 before the first)",
        "step_s": "median seconds of a step outside the step hook on rank 0 (0 before measured)",
        "copy_every": "buddy copies (FSDP on several nodes) every this many steps at most; null: none kept",
        "copy_cost_s": "median seconds a buddy copy holds rank 0's training thread (posting it, landing the one received; wall time); null: none kept",
    }),
    "buddy": EventKind("rank 0", "the generation's first buddy copy arrived (FSDP on several nodes, "
                       "checkpoint.memory_buddy): from now on a lost node restores from memory", {
        "step": "the step of the copy",
        "bytes": "bytes of the copy rank 0 holds (it keeps up to two: the newest and one being received)",
        "of_rank": "the rank whose snapshot rank 0 keeps a copy of",
        "slots": "buddy slots per rank",
    }),
    "drain": EventKind("rank 0", "stopped early after saving (SIGTERM or membership change)", {
        "step": "last step done and saved",
        "world_size": _WORLD,
        "saved": "memory (a drain only for a node joining, kept as a forced in-memory snapshot, no storage "
                 "write) or storage",
    }),
    "finish": EventKind("rank 0", "the job completed its last step", {
        "step": "final step",
        "loss": "final loss",
        "digest": "sha256 of the final parameters",
        "samples": "samples consumed",
        "world_size": _WORLD,
    }),
    "warning": EventKind("any", "something worth knowing that did not stop the job", {
        "message": "one line",
    }),
    "failure": EventKind("rank 0 (saves), any rank (fatal), or an agent (hang; exit: its worker group failed, "
                         "the cause first)", "something failed", {
        "message": "one line",
        "rank": "the rank that failed, where known",
        "fatal": "a mistake the user must fix: the host stops and prints it",
        "step": "step it happened at",
        "asynchronous": "checkpoint failures: the save was in the background",
        "consecutive": "checkpoint failures: how many in a row",
        "signature": "worker exceptions: stable hash of type, message and innermost frame",
        "where": "worker exceptions: file:line of the innermost frame",
        "node": "worker exceptions: the node of the rank",
        "restart": "worker exceptions: torchelastic's restart count of that node's agent",
        "generation": "worker exceptions: id of the worker generation, when it formed",
        "resumed_at": "worker exceptions: the step this attempt resumed from (None before it resumed)",
        "kept": "worker exceptions: the step this rank kept in its agent's memory on its way down "
                "(checkpoint.memory_on_failure; None when it kept none)",
        "cause": "'hang': the agent's step watchdog killed a worker that made no progress (no exception); "
                 "'node-lost': it stopped a stalled worker because peer nodes are gone (rendezvous.verdict); "
                 "'exit': an agent saw its worker group fail (which rank exited how, the cause first)",
        "seconds": "hang, node-lost: how long the worker had not re-armed its step timer when it was killed",
        "gone": "node-lost: the rendezvous nodes judged gone (dropped from the rendezvous)",
        "state": "hang: its /proc state letter before the kill ('T' stopped, 'D' uninterruptible, 'S' waiting)",
        "peer_lost": "worker exceptions: the message says a peer's connection closed or was reset (a peer died); "
                     "exit: every rank of this node only lost a peer (the cause is on another node)",
        "detail": "checkpoint failures: the full error (DCP's names each rank's traceback); the message has one line",
        "worker_pid": "exit: the process id of the rank that failed first",
        "exit_code": "exit: its exit code (negative: the signal that ended it)",
        "signal": "exit: the signal that ended it ('SIGKILL'), None when it exited with a code",
        "recorded": "exit: it recorded its own error (a worker exception), so its own failure event says more",
    }),
    "excluded": EventKind("an agent (rendezvous.exclusion)", "its node failed nodes.exclude_after times within "
                          "nodes.exclude_window (dropped while alive, or a worker that hung itself): it is kept "
                          "out of the job, its agent stops (exit 200)", {
        "node": "the node kept out",
        "message": "one line: why, and how to change it",
        "failures": "each failure counted (oldest first)",
        "window_s": "nodes.exclude_window",
    }),
    "spares": EventKind("host", "the hot spares were started, once the group formed (nodes.spares)", {
        "nodes": "the spares' node names",
        "world_size": "the group's world size when they started (the one a spare keeps)",
    }),
    "stall": EventKind("an agent", "a worker passed its stall bound (runtime.timer): the agent looks for "
                       "evidence that a peer node is gone (rendezvous.verdict); a node-lost failure follows if "
                       "it finds some, nothing if the peers are alive", {
        "node": "the agent's node",
        "rank": "the stalled worker's global rank",
        "step": "the job's last completed step",
        "seconds": "how long the worker had made no progress",
        "bound_s": "the stall bound it had given (derived from its measured steps)",
    }),
    "quarantine": EventKind("rank 0", "a checkpoint that failed verification or loading was set aside", {
        "step": "its step",
        "name": "its directory name",
        "reason": "why it failed",
        "kind": "'corrupt', 'unreadable', 'unloadable', 'forged' (signature wrong) or 'unsigned' (none; left in place unless it blocks this job's own save at that step)",
        "moved_to": "where it was moved (URI), or None if it was left in place",
        "message": "one line",
    }),
    "skipped": EventKind("rank 0", "a save did not happen: that step already has a complete checkpoint", {
        "step": "the step",
        "name": "its directory name",
        "reason": "why",
        "message": "one line",
    }),
    "fenced": EventKind("rank 0", "a superseded worker generation was refused a commit, purge or set-aside", {
        "step": "the step it tried to save",
        "name": "its directory name",
        "reason": "which generation superseded it",
        "message": "one line",
    }),
    "fault": EventKind("the worker hit (step-keyed) or the host", "an injected fault fired", {
        "kind": "a kind of chaos.vocabulary",
        "target": "rank or node index",
        "step": "last step completed before it",
        "rank": "worker-fired: the rank that fired it",
        "node": "the node it hit",
        "detail": "what was done, e.g. 'SIGKILL rank 1 (pid 123)'",
    }),
    "isolated": EventKind("an agent", "cut off from the rendezvous; it stops with its workers", {
        "node": "node name",
        "endpoint": "the rendezvous endpoint (with etcd, every member was probed)",
        "seconds": "how long it had been unreachable",
        "message": "one line",
    }),
    "workers": EventKind("an agent (agent.elastic)", "a phase of its worker group, for recovery timing", {
        "node": "node name",
        "state": "'failed' (an exit seen; warm starts only), 'stopped' (the group is down; cold "
                 "starts: also the first sign of a failure), 'broken' (a peer wrote the round broken: its "
                 "group failed, so this one's workers are stopped at once, or in place leave their step), "
                 "'unparked' (in place: a worker did not leave its step in time and is started anew) "
                 "or 'started'",
        "restart": "the agent's restart count",
        "warm": "workers are forked from the agent's zygote",
        "kept": "in place, 'started': pids of this node's workers that kept their process",
        "forked": "in place, 'started': pids of this node's workers started anew",
    }),
    "recovery": EventKind("rank 0 (runtime.build)", "a generation some workers entered with the process they "
                          "had (in-place recovery, runtime.inplace)", {
        "generation": "the new generation's id",
        "mode": "'repoint' (every member kept its process and its objects) or 'rerun' (the kept processes "
                "ran the training function again beside new workers)",
        "kept": "pids that kept their process, by rank order",
        "new": "pids of the workers started for this generation",
        "world_size": _WORLD,
    }),
    "finished": EventKind("rank 0 (runtime.repoint)", "a step finished in place without the ranks a fault took "
                          "(runtime.inflight)", {
        "step": "the step",
        "lost_dp_ranks": "the data-parallel ranks (of the generation the step began in) whose shares the "
                         "survivors computed",
        "extra_samples": "the samples of those shares this rank computed (rank 0's part)",
        "world_size": _WORLD,
        "message": "one line",
        "phases_s": "seconds, DDP (rank 0's): repoint (from its re-formation until its extra micro-batches "
                    "were loaded), extra (their forward and backward), reduce (the reduction at the new "
                    "membership); empty for HSDP's finish",
    }),
    "reformed": EventKind("each worker that kept its process (runtime.inplace)", "its re-formation's phases", {
        "rank": "its rank in the new generation",
        "mode": "'repoint' or 'rerun'",
        "phases_s": "seconds: leave (the fault until this rank parked), park (waiting for its place), "
                    "reform (groups and handshake)",
    }),
    "torchelastic": EventKind("an agent (agent.bridge)", "torchelastic's own agent/rendezvous event", {
        "node": "node name",
        "name": "torchelastic's event name",
        "source": "AGENT or WORKER, or the rendezvous source",
        "state": "agent/worker state, or the rendezvous node state",
        "message": "rendezvous message or raw error",
        "rank": "global rank, where torchelastic gives one",
    }),
    "exit": EventKind("host or agent", "it exited", {
        "who": "'host' or 'agent'",
        "node": "agent: its node name",
        "code": "exit code",
        "message": "why, when not 0",
    }),
}


class EventLog:
    """Appends events to one file. Safe to share between processes (see module doc)."""

    def __init__(self, path: str | Path, clock=time.time) -> None:
        self.path = Path(path)
        self._clock = clock
        self._owed: list[bytes] = []  # events a full disk refused, in short (``emit``)

    def emit(self, event: str, **fields: Any) -> dict:
        """Append one event. A log that cannot be written (a full disk, a lost mount) never
        ends a job: the event is said lost once per log and process on stderr. On a full
        disk the events refused, in short (``compact``: no ``detail``, long texts cut), are
        owed and written first by the next ``emit`` that finds room (a failed save frees its
        files a moment later), each owed line after a newline that ends a line the disk cut
        short: the line the terminal shows (say, the first failed save) survives, and the
        next event is never glued to a torn one."""
        record = {"t": round(self._clock(), 6), "event": event, "pid": os.getpid(), **fields}
        line = (json.dumps(record, sort_keys=False, default=str) + "\n").encode()
        short = b"\n" + (json.dumps(compact(record), default=str) + "\n").encode()
        try:
            if self._owed and not self._append(b"".join(self._owed)):
                self._owe(short)
            elif not self._append(line):
                self._owed = [short]
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            else:
                self._owed = []
        except OSError as e:
            _cannot_write(self.path, e)
        return record

    def _owe(self, short: bytes) -> None:
        """Still no room: owe this event too (the first ``MAX_OWED`` are kept)."""
        if len(self._owed) < MAX_OWED:
            self._owed.append(short)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def _append(self, data: bytes) -> bool:
        """One write of ``data``; False when it did not all fit (a full disk)."""
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            try:
                return os.write(fd, data) == len(data)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                return False
        finally:
            os.close(fd)


MAX_OWED = 16  # events a full disk refused that one log keeps to write later, in short


COMPACT_TEXT = 200  # characters a text field keeps when an event is written in short


def compact(record: dict) -> dict:
    """Pure: ``record`` in short (``EventLog.emit``): without ``detail``, texts cut."""
    return {k: (v[:COMPACT_TEXT] if isinstance(v, str) else v) for k, v in record.items() if k != "detail"}


_UNWRITABLE: set[str] = set()  # logs this process could not write to (said once each)


def _cannot_write(path: Path, e: OSError) -> None:
    if str(path) not in _UNWRITABLE:
        _UNWRITABLE.add(str(path))
        with contextlib.suppress(OSError, ValueError):
            print(f"warning: cannot write to {path} ({e.strerror or e}): events are lost until it can be "
                  "written again (free space on its disk)", file=sys.stderr, flush=True)


# The fields readers compute with (numbers, string tests, dict access), by the types they
# assume; None is always allowed (an optional value). Other fields are read with ``get``.
_INT, _NUM, _STR = (int,), (int, float), (str,)
FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "pid": _INT, "step": _INT, "world_size": _INT, "saved_world_size": _INT, "rank": _INT,
    "local_rank": _INT, "restart": _INT, "resumed_at": _INT, "samples": _INT, "code": _INT,
    "every": _INT, "nodes": (int, str), "node": (int, str),
    "loss": _NUM, "step_s": _NUM, "load_s": _NUM, "copy_s": _NUM, "blocking_s": _NUM, "waited_s": _NUM,
    "total_s": _NUM, "samples_per_s": _NUM, "eval_s": _NUM, "seconds": _NUM,
    "message": _STR, "name": _STR, "state": _STR, "who": _STR, "kind": _STR, "source": _STR,
    "signature": _STR, "cause": _STR, "digest": _STR, "where": _STR,
    "metrics": (dict,), "phases_s": (dict,),
}
# A field whose shape differs in one kind: that kind's own (``field_types``).
KIND_FIELD_TYPES: dict[str, dict[str, tuple[type, ...]]] = {
    "spares": {"nodes": (list,)},  # node names, where `start` and `rendezvous` count nodes
}


def field_types(kind: str) -> dict[str, tuple[type, ...]]:
    """The shapes readers accept for the fields of events of ``kind`` (None always allowed)."""
    own = KIND_FIELD_TYPES.get(kind)
    return {**FIELD_TYPES, **own} if own else FIELD_TYPES


# Fields a kind's readers index directly (``e["step"]``): such an event without them is skipped.
REQUIRED: dict[str, tuple[str, ...]] = {
    "step": ("step",), "finish": ("step",), "eval": ("step",),
    "drain": ("step",), "checkpoint": ("step",),
}


def well_formed(e: object) -> str:
    """Pure: why a parsed line is not an event the readers can use ("" when it is one)."""
    if not isinstance(e, dict):
        return f"a JSON {type(e).__name__}, not an object"
    t = e.get("t")
    if not isinstance(e.get("event"), str) or isinstance(t, bool) or not isinstance(t, (int, float)) \
            or not math.isfinite(t):
        return "no 'event' name or 't' time"
    missing = [f for f in REQUIRED.get(e["event"], ()) if e.get(f) is None]
    if missing:
        return f"a '{e['event']}' event without '{missing[0]}'"
    for name, types in field_types(e["event"]).items():
        value = e.get(name)
        if value is not None and not isinstance(value, types):
            return f"'{name}' is a JSON {type(value).__name__}"
    return ""


def parse_line(line: bytes) -> tuple[dict | None, str]:
    """Pure: (the event, "") or (None, why the line is not one)."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not UTF-8"
    try:
        e = json.loads(text)
    except ValueError:
        return None, "not JSON"
    why = well_formed(e)
    return (None, why) if why else (e, "")


# Logs read in this process that held lines which are not events: path -> (count, first reason).
_SKIPPED: dict[str, tuple[int, str]] = {}


def skipped_notes() -> list[str]:
    """One line per log read in this process that held lines which are not events (said
    once: the record is cleared)."""
    notes = [f"{path}: skipped {n} line(s) that are not events ({why}); the rest was read"
             for path, (n, why) in sorted(_SKIPPED.items())]
    _SKIPPED.clear()
    return notes


def read_events(path: str | Path) -> list[dict]:
    """All complete events; a torn last line (writer killed mid-write) is left out, and lines
    that are not events are skipped and counted (``skipped_notes``)."""
    return EventTail(Path(path), start_at_end=False).read()


class EventTail:
    """Reads the events appended since the last call: the incremental reader.

    Each ``read()`` reads only the bytes added since the previous one and keeps an
    incomplete last line for the next call. A file that shrank (replaced) is read again from
    its start. Not thread-safe: one reader per instance.
    """

    def __init__(self, path: Path, start_at_end: bool = True) -> None:
        self.path = Path(path)
        self.offset = self.path.stat().st_size if (start_at_end and self.path.exists()) else 0
        self._partial = b""
        self._line = None if self.offset else 0  # line number of the last complete line (from the start)
        self.skipped = 0  # lines that were not events (``parse_line``)
        self.first_skipped = ""  # the first one's line and reason

    def read(self, containing: bytes = b"") -> list[dict]:
        """The new complete events; with ``containing``, only lines holding those bytes are
        parsed (a cheap pre-filter: a long run's log is mostly step events)."""
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size < self.offset:
                    self.offset, self._partial, self._line = 0, b"", 0
                f.seek(self.offset)
                data = f.read()
        except (FileNotFoundError, NotADirectoryError):  # not written yet, or no such run dir
            return []
        self.offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        out = []
        for line in lines:
            if self._line is not None:
                self._line += 1
            if (containing and containing not in line) or not line.strip():
                continue
            e, why = parse_line(line)
            if e is not None:
                out.append(e)
            else:
                self._skip(why)
        return out

    def _skip(self, why: str) -> None:
        self.skipped += 1
        if not self.first_skipped:
            self.first_skipped = f"line {self._line}: {why}" if self._line is not None else why
        key = str(self.path)
        if self.skipped >= _SKIPPED.get(key, (0, ""))[0]:  # the fullest reading of that log
            _SKIPPED[key] = (self.skipped, f"first: {self.first_skipped}")
