"""Pure: which lines of which files in ``RUN_DIR/logs`` are a job's, and how to label them.

What a run directory's ``logs/`` holds (every submission appends to the same directory):

- ``agent-N.log``: node N's agent (one file per node, appended by every submission). Each
  agent writes ``agent_header`` first, naming its job, and ``worker_dir_line`` once
  torchelastic made its workers' log directory, so a file splits into per-job sections
  (a section runs from its header to the next, ``header_job``) and each worker directory
  belongs to one node.
- ``<rendezvous id>_<random>/attempt_K/<local rank>/stdout.log|stderr.log``: torchelastic's
  per-attempt worker files (``DefaultLogsSpecs``); K is the agent's restart count, which with
  the node and local rank gives the global rank (from the ``worker`` events, ``rank_map``).
- ``supervisor-<job id>.log``: a locally submitted job's supervisor (``run``, detached).
- ``slurm-<Slurm job id>.out``: a Slurm job's batch script.

Lines of the agent's own logging start with a time (``line_time``); worker lines carry none,
so ``--since`` keeps an untimed line with the timed line before it, and a worker file only
when it was written after that time.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable

_HEADER = re.compile(r"^=== elastic-harness agent: node (?P<node>\S+), job (?P<job>\S+), pid \d+, "
                     r"(?P<stamp>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) ===$")
_WORKERS = re.compile(r"^=== node (?P<node>\S+): worker logs of job (?P<job>\S+) in (?P<dir>.+) ===$")
_TIME = re.compile(r"^(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)")
# torch's own log lines (glog style): level letter, MMDD, time; the year is the reader's
_GLOG = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d:\d\d:\d\d)[.\d]* ")
# What ``logs`` leaves out of what it shows (``--all`` shows it; the files keep everything):
# torch's INFO lines (glog style, with or without a ``[rankN]:`` prefix) and the frames of a
# C++ stack trace (``Exception raised from ...`` and ``frame #N: ...``), folded into one line.
# (kubectl's ``--prefix`` puts ``[pod/NAME/CONTAINER] `` before each line)
_PREFIX = r"^(\[pod/[^\]]*\] )?(\[rank\d+\]:)?"
_TORCH_INFO = re.compile(_PREFIX + r"\[?I\d{4} \d\d:\d\d:\d\d")
_CPP_FRAME = re.compile(_PREFIX + r"(frame #\d+: |Exception raised from )")
_WORKER_FILE = re.compile(r"attempt_(?P<attempt>\d+)/(?P<local>\d+)/(?P<stream>stdout|stderr)\.log$")


def agent_header(node: str, job_id: str, pid: int, now: float) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
    return f"=== elastic-harness agent: node {node}, job {job_id}, pid {pid}, {stamp} ==="


def worker_dir_line(node: str, job_id: str, directory: str) -> str:
    return f"=== node {node}: worker logs of job {job_id} in {directory} ==="


def header_job(line: str) -> str | None:
    """The job an agent header names; None if ``line`` is not a header."""
    m = _HEADER.match(line)
    return m["job"] if m else None


def worker_dirs(lines: Iterable[str], job_id: str) -> dict[str, str]:
    """Worker log directory -> node, from the agents' ``worker_dir_line``s of ``job_id``."""
    found = {}
    for line in lines:
        m = _WORKERS.match(line)
        if m and m["job"] == job_id:
            found[m["dir"]] = m["node"]
    return found


def rank_map(events: Iterable[dict]) -> dict[tuple[str, int, int], int]:
    """(node, attempt, local rank) -> global rank, from the ``worker`` events."""
    out = {}
    for e in events:
        if e.get("event") == "worker" and e.get("rank") is not None:
            key = (str(e.get("node", "")), int(e.get("restart") or 0), int(e.get("local_rank") or 0))
            out[key] = int(e["rank"])
    return out


def worker_file(relative: str) -> tuple[int, int, str] | None:
    """``attempt_K/L/stdout.log`` -> (K, L, 'stdout'); None for other files."""
    m = _WORKER_FILE.search(relative)
    return (int(m["attempt"]), int(m["local"]), m["stream"]) if m else None


def line_time(line: str, year: int | None = None) -> float | None:
    """When a line was written, if it says: our agent's logging lines, torch's own (which
    omit the year: ``year``, default this one) and agent headers."""
    if (m := _TIME.match(line)) is not None:
        stamp = m[1].replace("T", " ")
    elif (g := _GLOG.match(line)) is not None:
        stamp = f"{year or time.localtime().tm_year}-{g[1]}-{g[2]} {g[3]}"
    elif (h := _HEADER.match(line)) is not None:
        stamp = h["stamp"]
    else:
        return None
    try:
        return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S"))
    except ValueError:
        return None


def since_filter(lines: Iterable[str], since: float | None, keep: bool = True) -> tuple[list[str], bool]:
    """Lines at or after ``since``; an untimed line goes with the timed one before it.
    ``keep``: whether the line before these was kept. Returns (lines, keep) to chain reads."""
    if since is None:
        return list(lines), True
    out = []
    for line in lines:
        t = line_time(line)
        keep = keep if t is None else t >= since
        if keep:
            out.append(line)
    return out, keep


def label(node: str | None, rank: int | None = None, attempt: int = 0, what: str = "") -> str:
    """The prefix of a line: ``[supervisor]`` (no node), ``[node 0 agent]``, ``[node 0 rank 1]``,
    ``[node 0 rank 1 stderr, restart 2]`` (``what`` names a rank's stream)."""
    if node is None:
        return f"[{what}]"
    who = (f"rank {rank}" + (f" {what}" if what else "")) if rank is not None else (what or "agent")
    return f"[node {node} {who}{f', restart {attempt}' if attempt else ''}]"


class Quiet:
    """Display filter for one stream, fed its lines in order (``feed`` per read): drops
    torch's INFO lines and folds each C++ stack trace into one line saying how to see it.
    The error message above a trace is kept; a trace split across two reads is folded in
    two parts (or feed it with ``end=False`` and once more at the end)."""

    def __init__(self) -> None:
        self.hidden = 0  # frames of the trace being folded

    def feed(self, lines: Iterable[str], end: bool = True) -> list[str]:
        """The lines to show; ``end=False`` keeps a trace at the end open for the next call
        (a stream read line by line), ``end=True`` folds it now."""
        out: list[str] = []
        for line in lines:
            if _CPP_FRAME.match(line):
                self.hidden += 1
                continue
            self._fold(out)
            if not _TORCH_INFO.match(line):
                out.append(line)
        if end:
            self._fold(out)
        return out

    def _fold(self, out: list[str]) -> None:
        if self.hidden:
            out.append(f"  [C++ stack trace, {self.hidden} lines: elastic-harness logs --all shows it]")
            self.hidden = 0
