"""``status``, ``list``, ``logs`` and ``stop``: a submitted (or ``run``) job, by id.

JOB is a job id (as ``submit`` printed it), a unique prefix of one, a job name (its newest
submission), or a run directory (its newest submission; also one the registry does not
know, e.g. started before it existed). See ``elastic_harness.lifecycle``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import time
from pathlib import Path

from elastic_harness import runfiles
from elastic_harness.errors import HarnessError
from elastic_harness.lifecycle import display, registry
from elastic_harness.lifecycle.api import LogQuery
from elastic_harness.lifecycle.registry import JobRecord
from elastic_harness.lifecycle.schedulers import scheduler_for, status_of
from elastic_harness.lifecycle.state import ACTIVE

_JOB_HELP = "job id (or a unique prefix, a job name, or a run directory)"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="a job's state, progress, restarts and last checkpoint")
    p.add_argument("job", nargs="?", help=_JOB_HELP + "; default: the newest job")
    p.add_argument("--json", action="store_true", help="print it as JSON")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("list", help="every known job and its state")
    p.add_argument("--json", action="store_true", help="print them as JSON")
    p.add_argument("--prune", action="store_true", help="forget the jobs that ended (their records only: run "
                                                       "directories, logs and checkpoints stay)")
    p.add_argument("--older-than", metavar="AGE", help="with --prune: only jobs submitted longer ago than AGE "
                                                       "(90s, 10m, 2h, 7d)")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("logs", help="a job's agent and worker logs, merged and prefixed")
    p.add_argument("job", help=_JOB_HELP)
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until the job ends")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int, help="only this global rank's worker logs")
    which.add_argument("--node", help="only this node's agent and worker logs")
    p.add_argument("--since", help="only what was written since: a duration (90s, 10m, 2h) or a time "
                                   "(HH:MM[:SS] today, or YYYY-MM-DD HH:MM[:SS])")
    p.add_argument("--all", action="store_true", help="also torch's INFO lines and C++ stack traces "
                                                      "(hidden by default; the files keep them)")
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser("stop", help="stop a job: drain and save (default), or --now kill it")
    p.add_argument("job", help=_JOB_HELP)
    p.add_argument("--now", action="store_true", help="kill it now, without draining (by pid or scheduler)")
    p.add_argument("--no-wait", action="store_true", help="return once asked, without waiting for it to end")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for it to end (default 300)")
    p.set_defaults(func=cmd_stop)


def resolve(ref: str | None, root: Path) -> JobRecord:
    """The record ``ref`` names (module doc). When a name or run directory matches several
    submissions, the newest is taken and a note on stderr says so, and how to pick another."""
    if ref is None:
        found = registry.records(root)
        if not found:
            raise HarnessError(f"no jobs in {root / 'jobs'}", "submit one (elastic-harness submit JOB.yaml)")
        return found[-1]
    path = Path(ref)
    if path.is_dir():
        return _record_of_run_dir(path.resolve(), root)
    if path.exists():
        raise HarnessError(f"'{ref}' is a file, not a job id or run directory", "pass a job id or a run directory")
    record = registry.find(ref, root)
    if record.id != ref:
        _say_which(ref, record, [r for r in registry.records(root) if r.name == ref])
    return record


def _say_which(ref: str, record: JobRecord, matches: list[JobRecord]) -> None:
    """A note (stderr: ``--json`` stays JSON) when ``ref`` matched more than one job."""
    if len(matches) > 1:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.submitted))
        print(f"note: {len(matches)} jobs match '{ref}'; this is the newest, {record.id} (submitted {when}); "
              "name another by its id (elastic-harness list shows them)", file=sys.stderr)


def _record_of_run_dir(run_dir: Path, root: Path) -> JobRecord:
    mine = [r for r in registry.records(root) if r.run_dir == str(run_dir)]
    if mine:
        _say_which(str(run_dir), mine[-1], mine)
        return mine[-1]
    from elastic_harness.events import read_events
    from elastic_harness.lifecycle.local import supervisor_of

    starts = [e for e in read_events(run_dir / runfiles.EVENTS) if e.get("event") == "start" and e.get("who") == "host"]
    if not starts:
        raise HarnessError(f"'{run_dir}' holds no job (no events.jsonl with a start)",
                           "pass the run directory of a job, or a job id (elastic-harness list)")
    return supervisor_of(run_dir, starts[-1])


def cmd_status(args: argparse.Namespace) -> int:
    root = registry.state_dir()
    record = resolve(args.job, root)
    st = status_of(record, root)
    print(json.dumps(st.to_dict(), indent=2) if args.json else display.detail(st))
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    root = registry.state_dir()
    before = _prune_before(args.older_than, args.prune)
    statuses = [status_of(r, root) for r in registry.records(root)]
    if args.prune:
        return _prune(statuses, root, before)
    if args.json:
        print(json.dumps([st.to_dict() for st in statuses], indent=2))
    elif statuses:
        print(display.table(statuses))
    else:
        print(f"no jobs in {root / 'jobs'}", file=sys.stderr)
    return 0


def _prune_before(older_than: str | None, prune: bool) -> float | None:
    """``--older-than AGE`` as unix seconds (None: no bound); refused without ``--prune``."""
    if older_than is None:
        return None
    if not prune:
        raise HarnessError("--older-than chooses which jobs --prune forgets", "add --prune, or leave it out")
    if not _DURATION.match(older_than.strip()):
        raise HarnessError(f"--older-than '{older_than}' is not an age", "write e.g. 90s, 10m, 2h or 7d")
    return parse_since(older_than, time.time())


def _prune(statuses: list, root: Path, before: float | None) -> int:
    """``list --prune``: forget the records of jobs that ended (submitted before ``before``,
    when given); jobs still pending or running are kept."""
    gone = [st for st in statuses if st.state not in ACTIVE and (before is None or st.submitted < before)]
    for st in gone:
        registry.forget(st.id, root)
    kept = len(statuses) - len(gone)
    print(f"forgot {len(gone)} job(s) that ended ({', '.join(st.id for st in gone) or 'none'}); {kept} kept; "
          "their run directories were not touched")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    root = registry.state_dir()
    since = parse_since(args.since, time.time()) if args.since else None
    record = resolve(args.job, root)
    if record.run_dir and (args.rank is not None or args.node is not None):
        check_log_target(record, args.rank, args.node, root)
    query = LogQuery(follow=args.follow, rank=args.rank, node=args.node, since=since, all=args.all)
    out = _Counted(sys.stdout)
    with contextlib.suppress(KeyboardInterrupt):  # the way to end `logs -f`
        scheduler_for(record.scheduler, root).logs(record, query, out)
    if not out.written:
        raise _no_logs(record, args)
    return 0


class _Counted:
    """``out``, counting what was written (``logs`` of a job with none says so)."""

    def __init__(self, out) -> None:
        self.out, self.written = out, 0

    def write(self, text: str) -> int:
        self.written += len(text)
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()


def _no_logs(record: JobRecord, args: argparse.Namespace) -> HarnessError:
    """The line for a job without logs (or none matching the filters): where they would be."""
    which = "".join(f" {flag} {value}" for flag, value in (("--rank", args.rank), ("--node", args.node),
                                                         ("--since", args.since)) if value is not None)
    where = (f"nothing in {Path(record.run_dir) / runfiles.LOGS} is this submission's" if record.run_dir
             else "the scheduler returned none")
    error = HarnessError(f"job {record.id} has no logs{which and ' for' + which}: {where}",
                         f"it may not have started (elastic-harness status {record.id}); "
                         + ("leave out the filters to see every log" if which else
                            "an older submission of the same name has its own id (elastic-harness list)"))
    error.exit_code = 1  # nothing found, as grep says it; not a mistake in the arguments
    return error


def check_log_target(record: JobRecord, rank: int | None, node: str | None, root: Path) -> None:
    """``logs --rank R`` / ``--node N`` of a rank or node the job never had: say which it has
    (instead of printing nothing). A job still running may grow: only its ranks so far count
    as known then, and an unknown one is allowed (it may join)."""
    from elastic_harness.lifecycle.observe import submission_events
    from elastic_harness.lifecycle.state import invocation_of

    workers = [e for e in invocation_of(submission_events(Path(record.run_dir), record.id), record.id)
               if e.get("event") == "worker"]
    ranks = sorted({int(e["rank"]) for e in workers if e.get("rank") is not None})
    nodes = sorted({str(e.get("node", "")) for e in workers})
    if not workers or scheduler_for(record.scheduler, root).status(record).state in ACTIVE:
        return
    if rank is not None and rank not in ranks:
        raise HarnessError(f"job {record.id} has no rank {rank}: its ranks were {_span(ranks)}",
                           f"pass --rank {ranks[0]}..{ranks[-1]}, or leave --rank out for every log")
    if node is not None and node not in nodes:
        raise HarnessError(f"job {record.id} has no node '{node}': its nodes were {', '.join(nodes)}",
                           "pass one of them to --node, or leave --node out for every log")


def _span(values: list[int]) -> str:
    return f"{values[0]}..{values[-1]}" if values == list(range(values[0], values[-1] + 1)) and len(values) > 1 \
        else ", ".join(map(str, values))


def cmd_stop(args: argparse.Namespace) -> int:
    if args.timeout <= 0:
        raise HarnessError(f"--timeout {args.timeout} is not a positive number of seconds", "e.g. --timeout 600")
    root = registry.state_dir()
    record = resolve(args.job, root)
    sched = scheduler_for(record.scheduler, root)
    st = sched.status(record)
    if st.state not in ACTIVE:  # already where stop would take it: say so, as TorchX's cancel
        print(f"job {record.id} is not running: it {_ended(st)}; nothing to stop")
        return 0
    registry.request_stop(record, root, now=args.now)
    sched.stop(record, args.now)
    if args.no_wait:
        print(f"stop requested: {record.id}" + ("" if args.now else " (draining)"))
        return 0
    deadline = time.monotonic() + args.timeout
    while st.state in ACTIVE:
        if time.monotonic() > deadline:
            raise HarnessError(f"job {record.id} is still {st.state} after {args.timeout:.0f} s",
                               f"wait longer (status {record.id}), or kill it: elastic-harness stop --now {record.id}")
        time.sleep(0.5)
        st = sched.status(record)
    print(f"{record.id} {st.state}" + (f": {st.reason}" if st.reason else ""))
    return 0


def _ended(st) -> str:
    return {"succeeded": "succeeded", "failed": "failed", "stopped": "was stopped",
            "preempted": "was preempted"}[st.state] + (f" ({st.reason})" if st.reason else "")


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")


def parse_since(text: str, now: float) -> float:
    """``--since``: a duration back from ``now`` or a wall time -> unix seconds (pure)."""
    text = text.strip()
    m = _DURATION.match(text)
    if m:
        return now - float(m[1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m[2]]
    day = time.strftime("%Y-%m-%d", time.localtime(now))
    for candidate, fmt in ((text, "%Y-%m-%d %H:%M:%S"), (text, "%Y-%m-%d %H:%M"), (text.replace("T", " "), "%Y-%m-%d %H:%M:%S"),
                           (f"{day} {text}", "%Y-%m-%d %H:%M:%S"), (f"{day} {text}", "%Y-%m-%d %H:%M")):
        try:
            return time.mktime(time.strptime(candidate, fmt))
        except ValueError:
            continue
    raise HarnessError(f"--since '{text}' is neither a duration nor a time",
                       "write e.g. 90s, 10m, 2h, 14:30, or '2026-01-31 14:30'")
