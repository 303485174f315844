"""``bench recovery --only scale-up`` and ``--only churn``: nodes joining a running job.

- scale-up: a 1-node job (nodes 1..2, one rank per node) is joined by a second node at step
  ``SCALE_UP_AT``; measured from the new node's arrival (its agent up and joining) to the
  first step at world size 2 (``join_stats``). Two arms alternate, ``--repeats`` runs each:
  ``peer`` (the defaults: the joiner receives the state from the running node over the
  checkpoint group, no storage read) and ``storage`` (the in-memory tier off,
  ``checkpoint.memory_every=0``: every rank loads the drain's checkpoint). Reported: the
  ratio of the medians peer / storage, the median of each phase per arm, and every run's
  record (with the ``resume`` event's ``source``, which shows that the peer arm read no
  storage).
- churn: a 2-node job (one rank per node) in which the non-host node is killed every
  ``--churn-every`` seconds and a replacement started ``--churn-replace-after`` seconds
  later, for ``--churn-duration`` seconds counted from the job's first step; then the bench
  stops the run (SIGINT to the host: a graceful drain). The bench asks for each fault when
  it is due (``chaos.inject.request``, what ``elastic-harness chaos RUN_DIR FAULT`` does), so
  the schedule runs on training time: a loaded machine's slow start does not eat it. Reported: goodput (``goodput``'s one definition, over the whole run:
  start-up and the final drain included) with its badput breakdown, start-up by phase
  (``startup_stats``), every kill's recovery, every join's record, and where each join's
  drain kept the state (``join_drains``: memory, or a storage write). Node 0 hosts the rendezvous store (as a real job's store host),
  so the churn hits the other node: kill node 1, start node 2, kill node 2, start node 3...
  The goal (>= 0.98) is judged at its own setting only (a kill every <= 120 s over >= 600 s);
  a shorter run says so in the JSON and is a test of the plumbing.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from elastic_harness import runfiles
from elastic_harness.bench.recovery import crash_stats, join_stats, startup_stats
from elastic_harness.bench.recovery.launching import (
    BenchJob,
    _signal_group,
    _spawn,
    log_tails,
    write_job,
)
from elastic_harness.chaos.inject import request
from elastic_harness.events import EventTail, read_events
from elastic_harness.report.timeline import build

SCALE_UP_AT = 30  # step at which the second node is started
SCALE_UP_STEPS_AFTER = 5  # steps at the new size before the bench stops the run
ARMS = {"peer": [], "storage": ["checkpoint.memory_every=0"]}
CHURN_GOAL = 0.98
CHURN_GOAL_SETTING = (600.0, 120.0)  # (at least this long, a kill at least this often)
CHURN_CKPT_EVERY = 50  # the spec's default durable interval
MODEL = {"hidden": 256, "depth": 3, "batch": 64, "micro": 32}  # the goodput bench's job


def bench_scale_up(scratch: Path, repeats: int, hidden: int = MODEL["hidden"]) -> dict:
    """``repeats`` runs of each arm, alternating; see the module doc. ``hidden``: the MLP's
    width (the state grows with its square: 256 is 1.6 MB with AdamW, 2048 about 100 MB)."""
    job = write_job(scratch / "scale-up.yaml",
                    BenchJob(steps=10**7, max_restarts=3, max_nodes=2, every=CHURN_CKPT_EVERY,
                             **{**MODEL, "hidden": hidden}))
    runs: dict[str, list] = {arm: [] for arm in ARMS}
    for r in range(repeats):
        for arm, sets in ARMS.items():
            run_dir = scratch / f"scale-up-{arm}-{r}"
            code = run_harness_until(job, run_dir, nodes=1, chaos=[f"add-node@{SCALE_UP_AT}"], sets=sets,
                                     done=_grown(run_dir), timeout=300)
            events = read_events(run_dir / runfiles.EVENTS)
            found = join_stats.joins(events)
            record = {"exit": code, **(found[0] if found else {"join_s": None})}
            if not found or found[0]["join_s"] is None:
                record["log_tails"] = log_tails(run_dir)
            runs[arm].append(record)
    return {**scale_up_result(runs, repeats), "mlp_hidden": hidden}


def scale_up_result(runs: dict[str, list], repeats: int) -> dict:
    """Pure: medians per arm, the ratio peer / storage and the peer arm's sources."""
    med = {arm: join_stats.median_phases(rs) for arm, rs in runs.items()}
    peer, storage = med["peer"]["join_s"], med["storage"]["join_s"]
    sources = {arm: [r.get("source") for r in rs] for arm, rs in runs.items()}
    return {
        "ratio": round(peer / storage, 3) if peer is not None and storage else None,
        "restore_ratio": (round(med["peer"]["restore"] / med["storage"]["restore"], 3)
                          if med["peer"]["restore"] is not None and med["storage"]["restore"] else None),
        "peer_median_join_s": peer, "storage_median_join_s": storage,
        "median_phases_s": med, "sources": sources,
        "no_storage_read": bool(sources["peer"]) and all(s == "peer" for s in sources["peer"]),
        "measure": "the new node's agent first attempting to join the rendezvous -> first step at the new world "
                   "size (boot_s: process start -> that attempt, the agent's and its zygote's imports, not counted)",
        "arms": {arm: sets or ["defaults"] for arm, sets in ARMS.items()}, "repeats": repeats,
        "joined_at_step": SCALE_UP_AT, "runs": runs,
    }


def bench_churn(scratch: Path, duration: float, every: float, replace_after: float) -> dict:
    """One harness run under a kill-and-replace schedule; see the module doc."""
    job = write_job(scratch / "churn.yaml",
                    BenchJob(steps=10**7, max_restarts=1000, max_nodes=2, every=CHURN_CKPT_EVERY, **MODEL))
    run_dir = scratch / "churn"
    schedule = churn_schedule(duration, every, replace_after)
    code = run_harness_until(job, run_dir, nodes=2, chaos=[], sets=[], done=_churn(run_dir, schedule, duration),
                             timeout=int(duration) + 600)
    events = read_events(run_dir / runfiles.EVENTS)
    out = churn_result(events, [f"{text}@+{at:g}s" for at, text in schedule], code, duration, every)
    if code not in (0, 130, 143):
        out["log_tails"] = log_tails(run_dir)
    return out


def churn_schedule(duration: float, every: float, replace_after: float) -> list[tuple[float, str]]:
    """Pure: (seconds after the first step, fault): kill the newest non-host node every
    ``every`` s, start its replacement ``replace_after`` s later (``add-node`` numbers nodes
    on: 2, 3, ...); a kill whose replacement would not start before ``duration`` is left out."""
    out, node, t = [], 1, every
    while t + replace_after < duration:
        out += [(t, f"kill-node:{node}"), (t + replace_after, "add-node")]
        node, t = node + 1, t + every
    return out


def churn_result(events: list[dict], schedule: list[str], code: int | None, duration: float,
                 every: float) -> dict:
    """Pure: goodput and its breakdown, the faults fired, every kill's recovery and join."""
    tl = build(events)
    g = tl.goodput
    kills = [f for f in tl.faults if f.kind == "kill-node"]
    fired = [e for e in events if e["event"] == "fault"]
    joined = join_stats.joins(events)
    resumes = [e.get("source", "fresh" if e.get("fresh") else None) for e in events if e["event"] == "resume"]
    drains = startup_stats.drain_saves(events)
    at_setting = duration >= CHURN_GOAL_SETTING[0] and every <= CHURN_GOAL_SETTING[1]
    return {
        "exit": code, "duration_s": duration, "every_s": every, "schedule": schedule,
        "wall_s": g.wall_s, "productive_s": g.productive_s, "goodput": g.goodput, "badput_s": g.badput,
        # Not the goal's figure: what the churn itself cost, start-up (one-off, load-bound) left out.
        "goodput_after_startup": (round(g.productive_s / (g.wall_s - g.badput["startup"]), 4)
                                  if g.wall_s > g.badput["startup"] else None),
        "faults_fired": {k: sum(1 for e in fired if e.get("kind") == k) for k in ("kill-node", "add-node")},
        "faults_scheduled": len(schedule),
        "kills": [{"t": round(f.t, 3), "step": f.step, "recovery_s": f.recovery_s, "steps_lost": f.steps_lost}
                  for f in kills],
        "median_kill_recovery_s": crash_stats.median_of([f.recovery_s for f in kills]),
        "mean_steps_lost_per_kill": crash_stats.mean_of([f.steps_lost for f in kills]),
        "joins": joined, "median_join": join_stats.median_phases(joined),
        # Start-up (goodput's term) by phase, and where each join's drain kept the state:
        # ``storage_writes`` drains for a join that wrote a storage checkpoint (0: memory).
        "startup": startup_stats.startup_phases(events),
        "join_drains": drains,
        "storage_writes_per_join": round(drains["storage_writes"] / len(joined), 3) if joined else None,
        "resume_sources": {s: resumes.count(s) for s in sorted(set(map(str, resumes)))},
        "world_sizes": sorted({e["world_size"] for e in events if e["event"] == "step" and "world_size" in e}),
        "goal": f"goodput >= {CHURN_GOAL} with a node killed and replaced every {CHURN_GOAL_SETTING[1]:g} s "
                f"over {CHURN_GOAL_SETTING[0]:g} s",
        "at_goal_setting": at_setting,
        "met": at_setting and g.goodput >= CHURN_GOAL,
    }


# --- launching ------------------------------------------------------------------------------


def _grown(run_dir: Path) -> Callable[[], bool]:
    """True once a generation at world size 2 completed ``SCALE_UP_STEPS_AFTER`` steps."""
    tail = EventTail(run_dir / runfiles.EVENTS, start_at_end=False)
    seen: dict[int, int] = {}

    def check() -> bool:
        for e in tail.read(containing=b'"step"'):
            if e.get("event") == "step" and e.get("world_size") == 2:
                seen[e["pid"]] = seen.get(e["pid"], 0) + 1
        return any(n >= SCALE_UP_STEPS_AFTER for n in seen.values())

    return check


def _churn(run_dir: Path, schedule: list[tuple[float, str]], duration: float) -> Callable[[], bool]:
    """Asks for each fault of ``schedule`` once due (times from the first step event); True
    once ``duration`` s have passed since that step."""
    tail = EventTail(run_dir / runfiles.EVENTS, start_at_end=False)
    pending = list(schedule)
    first: list[float] = []

    def check() -> bool:
        if not first:
            steps = [e for e in tail.read(containing=b'"step"') if e.get("event") == "step"]
            if not steps:
                return False
            first.append(steps[0]["t"])
        elapsed = time.time() - first[0]
        while pending and pending[0][0] <= elapsed:
            request(run_dir, pending.pop(0)[1])
        return elapsed >= duration

    return check


def run_harness_until(job: Path, run_dir: Path, *, nodes: int, chaos: list[str], sets: list[str],
                      done: Callable[[], bool], timeout: int) -> int | None:
    """``elastic-harness run`` (one rank per node) until it exits or ``done()``; then SIGINT
    (the host drains its agents), SIGKILL after 60 s. Its exit code; None if it was killed."""
    cmd = [sys.executable, "-m", "elastic_harness", "run", str(job), "--run-dir", str(run_dir),
           "--nodes", str(nodes), "--nproc-per-node", "1"]
    cmd += [a for s in sets for a in ("--set", s)] + [a for c in chaos for a in ("--chaos", c)]
    run_dir.mkdir(parents=True, exist_ok=True)
    proc = _spawn(cmd, run_dir / "bench-host.log", None)
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline and not done():
            time.sleep(0.5)
    except BaseException:  # interrupted: leave nothing running
        _stop(proc)
        raise
    return _stop(proc)


def _stop(proc: subprocess.Popen) -> int | None:
    if proc.poll() is None:
        _signal_group(proc, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
            return None
    return proc.returncode
