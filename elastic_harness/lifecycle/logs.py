"""``elastic-harness logs``: a job's logs from its run directory, merged and prefixed.

Which files and lines belong to which job, node and rank is decided in ``logsource``; this
module reads them. Each file is a ``_Stream`` read from where it was left (only new bytes),
so following costs a stat and a read per file per poll, and a line is printed once, whole.

Order: without ``follow``, the supervisor's (or Slurm batch script's) log, then each node's
agent, then each worker file by restart and rank, each whole. With ``follow``, after that
every new line as it is read, from whichever file; new restarts' files are found as their
agents announce them. Following ends when ``active()`` says the job's processes are gone
(after a last read, so the supervisor's final lines are shown), or on Ctrl-C.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TextIO

from elastic_harness import runfiles
from elastic_harness.events import EventTail
from elastic_harness.lifecycle import logsource
from elastic_harness.lifecycle.api import LogQuery


class _Stream:
    """One file, read incrementally; ``agent`` streams keep only the job's sections."""

    def __init__(self, path: Path, label: str, node: str | None = None, agent_of: str = "",
                 rank: int | None = None, since: float | None = None) -> None:
        self.path, self.label, self.node, self.rank = path, label, node, rank
        self.agent_of = agent_of  # the job id whose sections to keep ("" = keep every line)
        self.offset, self.partial = 0, b""
        self.in_section = not agent_of
        self.since, self.keep = since, True
        self.seen: list[str] = []  # agent streams: the job's lines (for worker_dirs)
        self.quiet = logsource.Quiet()  # what is shown, unless the query asks for all

    def read(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        return self._select([line.decode(errors="replace") for line in lines])

    def _select(self, lines: Iterable[str]) -> list[str]:
        out = []
        for line in lines:
            job = logsource.header_job(line) if self.agent_of else None
            if job is not None:
                self.in_section = job == self.agent_of
            if self.in_section:
                self.seen.append(line)
                kept, self.keep = logsource.since_filter([line], self.since, self.keep)
                out += kept
        return out


class LogReader:
    """A job's log streams under ``run_dir/logs``; ``extra``: (file name, label) pairs of
    job-wide logs (the supervisor's, the Slurm batch script's)."""

    def __init__(self, run_dir: Path, job_id: str, query: LogQuery, extra: Iterable[tuple[str, str]] = (),
                 events: Path | None = None) -> None:
        self.logs, self.job_id, self.query = Path(run_dir) / runfiles.LOGS, job_id, query
        # ``events``: the event log holding this job (``observe.submission_log``: --fresh moves logs)
        self.events = EventTail(events or Path(run_dir) / runfiles.EVENTS, start_at_end=False)
        self.ranks: dict[tuple[str, int, int], int] = {}
        self.streams: dict[Path, _Stream] = {}
        self.pending_workers: set[Path] = set()  # files whose rank is not known yet
        if query.rank is None and query.node is None:
            for name, what in extra:
                self._add(_Stream(self.logs / name, logsource.label(None, what=what), since=query.since))

    def _add(self, stream: _Stream) -> _Stream:
        return self.streams.setdefault(stream.path, stream)

    def discover(self) -> None:
        """Find agent files, and the worker files their agents announced."""
        for path in sorted(self.logs.glob("agent-*.log")):
            node = path.stem.removeprefix("agent-")
            self._add(_Stream(path, logsource.label(node), node=node, agent_of=self.job_id,
                              since=self.query.since))
        self.ranks.update(logsource.rank_map(self.events.read()))
        for stream in [s for s in self.streams.values() if s.agent_of]:
            for directory, node in logsource.worker_dirs(stream.seen, self.job_id).items():
                for path in sorted(Path(directory).glob("attempt_*/*/std*.log")):
                    self._worker(path, node, str(path.relative_to(directory)))

    def _worker(self, path: Path, node: str, relative: str) -> None:
        parsed = logsource.worker_file(relative)
        if parsed is None or path in self.streams:
            return
        attempt, local, stream = parsed
        rank = self.ranks.get((node, attempt, local))
        if rank is None:
            self.pending_workers.add(path)
            return  # its rank is not known yet (its `worker` event not read): next round
        self.pending_workers.discard(path)
        if self.query.node not in (None, node) or self.query.rank not in (None, rank):
            return
        since = self.query.since
        if since is not None and _mtime(path) < since:
            return
        what = logsource.label(node, rank, attempt, "stderr" if stream == "stderr" else "")
        self._add(_Stream(path, what, node=node, rank=rank))

    def _shown(self, stream: _Stream) -> bool:
        """Every agent stream is read, for the worker files it announces; shown only when
        the query asks for agents (no --rank) of its node."""
        if not stream.agent_of:
            return True
        return self.query.rank is None and self.query.node in (None, stream.node)

    def _pass(self, out: TextIO) -> None:
        for stream in sorted(self.streams.values(), key=_order):
            lines = stream.read()
            if self._shown(stream):
                _write(out, stream.label, lines if self.query.all else stream.quiet.feed(lines))

    def dump(self, out: TextIO) -> None:
        """Everything so far, file by file (module doc). Twice: the agents read in the first
        pass announce the worker files the second pass reads."""
        for _ in range(2):
            self.discover()
            self._pass(out)

    def follow(self, out: TextIO, active: Callable[[], bool], poll_s: float = 0.25,
               check_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        """After ``dump``: print new lines until ``active()`` is False (module doc)."""
        last_check, running = clock(), True
        while running:
            if clock() - last_check >= check_s:
                last_check, running = clock(), active()
            self.discover()
            self._pass(out)
            if running:
                time.sleep(poll_s)


def _order(stream: _Stream) -> tuple:
    kind = 0 if stream.node is None else (1 if stream.agent_of else 2)
    return (kind, stream.node or "", stream.rank if stream.rank is not None else -1, str(stream.path))


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _write(out: TextIO, label: str, lines: list[str]) -> None:
    for line in lines:
        out.write(f"{label} {line}\n")
    if lines:
        out.flush()
