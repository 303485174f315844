"""``bench recovery`` parts for node failures as clusters have them.

- kill-node (``--nodes N``): node 1 of N SIGKILLed at step 40 (agent and workers; its
  kernel resets their connections). Rows, measured in alternating runs: the harness with
  every node on one host (``same_host``), the harness with every node a simulated host of
  its own (``separate_hosts``: ``run --separate-hosts``, own pid, UTS and network
  namespaces; needs root, else the row says why it is missing), and torchrun (same host).
  Each row: median recovery (fault to the first step after it), the median of each phase
  (``crash_stats.breakdown``) and its ratio to torchrun's median.
- hang-node: node 1 of N frozen (SIGSTOP of its agent and every worker, fired by the host
  at step 40): no connection is reset. Same rows; torchrun gets the same fault from this
  bench (SIGSTOP of its node-1 agent's process group and of its workers). A launcher that
  has not recovered ``HANG_BOUND_S`` after the fault is stopped there, and its run says so
  (``recovered: false``, ``stopped_at_bound_s``) instead of a time.

Every row also says the machine's load when it ran (``os.getloadavg``): figures from a busy
machine are indicative only; and each run how busy every CPU was from the fault to the first
step after it (``cpu_busy``, ``bench.cpuwindow``): near 1, the recovery waited for CPU (N
simulated nodes restarting on a few cores), not for the protocol; and how many CPU seconds
every process together spent in that window (``cpu_s``: at N nodes, N-1 of them restart).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from elastic_harness import runfiles
from elastic_harness.bench import cpuwindow
from elastic_harness.bench.recovery import crash_stats, kept
from elastic_harness.bench.recovery.launching import (
    BenchJob,
    _signal_group,
    _spawn,
    _wait_for_port,
    torchrun_command,
    torchrun_environ,
    write_job,
)
from elastic_harness.events import EventLog, EventTail, read_events
from elastic_harness.report import inplace
from elastic_harness.report.timeline import build

FAULT_STEP = 40
HANG_BOUND_S = 240.0  # a frozen node not recovered from this long after the fault: stopped here
GOAL_HANG_S = 5.0  # the goal: a frozen node recovered within 5 s (quiet machine)
GOAL_SEPARATE_S = 0.5  # a killed node on another host within 0.5 s


def rows_for(root: bool) -> list[str]:
    """Pure: the harness rows this machine can measure (separate hosts need root)."""
    return ["same_host", "separate_hosts"] if root else ["same_host"]


def bench_node_fault(scratch: Path, kind: str, repeats: int, nodes: int, parallelism: str = "ddp") -> dict:
    """``kind`` (kill-node or hang-node) on node 1 of ``nodes``; rows alternate per repeat."""
    job = write_job(scratch / f"{kind}.yaml",
                    BenchJob(steps=100, max_restarts=3, max_nodes=nodes, every=50, parallelism=parallelism))
    job = _one_rank_per_node(job)
    rows = rows_for(os.geteuid() == 0)
    runs: dict[str, list] = {name: [] for name in [*rows, "torchrun"]}
    skipped = 0
    for r in range(repeats):
        for name in [*rows, "torchrun"]:
            if name == "torchrun" and gave_up(runs["torchrun"]):
                skipped += 1
                continue
            run_dir = scratch / f"{kind}-{nodes}-{name}-{r}"
            load = os.getloadavg()[0]
            with cpuwindow.Sampler() as cpu:
                if name == "torchrun":
                    result = torchrun_fault(job, run_dir, nodes, kind, samples=cpu.samples)
                else:
                    code = harness(job, run_dir, nodes, kind, separate=name == "separate_hosts")
                    result = measure(run_dir, code, samples=cpu.samples)
            runs[name].append({**result, "load": round(load, 2)})
    out = {"fault": f"{kind}:1@{FAULT_STEP}", "nodes": nodes, "nproc_per_node": 1, "repeats": repeats,
           "rows": {name: summarize(v, runs["torchrun"]) for name, v in runs.items()},
           **skipped_note(skipped)}
    if os.geteuid() != 0:
        out["rows"]["separate_hosts"] = {"skipped": "needs root (network, pid and UTS namespaces)"}
    return {**out, **goals(kind, out["rows"])}


def gave_up(torchrun_runs: list[dict]) -> bool:
    """Pure: did a torchrun repeat already run into the bench's bound without recovering? Its
    later repeats at this size are skipped: each would wait out the same bound (minutes)."""
    return any(r.get("stopped_at_bound") or r.get("stopped_at_bound_s") for r in torchrun_runs)


def skipped_note(skipped: int) -> dict:
    """Pure: what the JSON says of torchrun repeats skipped after one gave up (``gave_up``)."""
    if not skipped:
        return {}
    return {"torchrun_repeats_skipped": skipped,
            "torchrun_skipped_why": "an earlier repeat did not recover before the bound; each would wait it out again"}


def _one_rank_per_node(job: Path) -> Path:
    """The bench's job with one rank per node (nodes are what fails here)."""
    job.write_text(job.read_text().replace("nproc_per_node: 2", "nproc_per_node: 1"))
    return job


def summarize(runs: list[dict], torchrun: list[dict]) -> dict:
    """Pure: one row: median recovery, its phases (a restart's, and in place's), its ratio to
    torchrun's, how its faults were recovered and who kept its process (``kept.tally``), the
    machine's median load, the runs."""
    med = crash_stats.median_of([r.get("recovery_s") for r in runs])
    theirs = crash_stats.median_of([r.get("recovery_s") for r in torchrun])
    phases = crash_stats.median_breakdown([r["phases"] for r in runs if r.get("phases")])
    in_place = crash_stats.median_breakdown([r["in_place_phases"] for r in runs if r.get("in_place_phases")],
                                            inplace.PHASES)
    return {"median_s": med, "phases_median_s": phases, "in_place_phases_median_s": in_place,
            "kept": kept.tally(runs), "load_median": crash_stats.median_of([r.get("load") for r in runs]),
            "cpu_busy_median": crash_stats.median_of([r.get("cpu_busy") for r in runs]),
            "cpu_s_median": crash_stats.median_of([r.get("cpu_s") for r in runs]),
            "ratio_to_torchrun": round(med / theirs, 4) if med is not None and theirs else None,
            "recovered": sum(bool(r.get("recovered", r.get("recovery_s") is not None)) for r in runs), "of": len(runs),
            "stopped_at_bound": sum(bool(r.get("stopped_at_bound_s") or r.get("stopped_at_bound")) for r in runs),
            "runs": runs}


def goals(kind: str, rows: dict) -> dict:
    """Pure: the issue's goals for ``kind`` against the rows measured."""
    if kind == "hang-node":
        meds = [rows[n]["median_s"] for n in ("same_host", "separate_hosts") if "median_s" in rows.get(n, {})]
        return {"goal": f"harness median <= {GOAL_HANG_S} s (quiet machine), every row",
                "met": bool(meds) and all(m is not None and m <= GOAL_HANG_S for m in meds)}
    sep = rows.get("separate_hosts", {}).get("median_s")
    return {"goal": f"separate hosts median <= {GOAL_SEPARATE_S} s (quiet machine)",
            "met": sep is not None and sep <= GOAL_SEPARATE_S}


def measure(run_dir: Path, code: int | None, bound_hit: float | None = None,
            samples: list | None = None) -> dict:
    """One run's recovery from its first fault: time, phases, steps lost, in place or restarted
    and the survivors that kept their process (``report``'s, ``kept.of_fault``); with
    ``samples`` (``cpuwindow.Sampler``'s, around the run) also how busy the machine's CPUs
    were from the fault to the first step after it: ``cpu_busy`` (near 1: the recovery waited
    for CPU, not for the protocol) and ``cpu_s`` (busy CPU seconds, every process together)."""
    events = read_events(run_dir / runfiles.EVENTS)
    faults = build(events).faults
    row = faults[0] if faults else None
    fault = next((e for e in events if e["event"] == "fault"), None)
    recovered = row is not None and row.recovery_s is not None and not bound_hit
    window = (fault["t"], fault["t"] + row.recovery_s) if recovered and fault and samples is not None else None
    return {"cpu_busy": cpuwindow.busy_fraction(samples, *window) if window else None,
            "cpu_s": cpuwindow.busy_seconds(samples, *window) if window else None,
            "exit": code, "fired": row is not None, "recovered": recovered,
            "recovery_s": row.recovery_s if recovered else None,
            "phases": crash_stats.breakdown(events, fault) if recovered and fault else None,
            "world_size_before": row.world_size_before if row else None,
            "world_size_after": row.world_size_after if row else None,
            "steps_lost": row.steps_lost if row else None,
            "stopped_at_bound_s": bound_hit,
            **kept.of_fault(row.recovered_how if recovered else None)}


# --- the harness ----------------------------------------------------------------------------


def harness(job: Path, run_dir: Path, nodes: int, kind: str, separate: bool, sets: tuple[str, ...] = (),
            timeout: float = 600.0) -> int | None:
    cmd = [sys.executable, "-m", "elastic_harness", "run", str(job), "--run-dir", str(run_dir),
           "--nodes", str(nodes), "--nproc-per-node", "1", "--chaos", f"{kind}:1@{FAULT_STEP}",
           *(a for s in sets for a in ("--set", s))]
    if separate:
        cmd.append("--separate-hosts")
    run_dir.mkdir(parents=True, exist_ok=True)
    proc = _spawn(cmd, run_dir / "bench-host.log", dict(os.environ))
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _signal_group(proc, signal.SIGINT)  # the host stops its nodes
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=60)
        _signal_group(proc, signal.SIGKILL)
        proc.wait()
        return None
    except BaseException:
        _signal_group(proc, signal.SIGINT)
        raise


# --- torchrun, with the fault fired from here ---------------------------------------------------


def torchrun_fault(job: Path, run_dir: Path, nodes: int, kind: str, bound_s: float = HANG_BOUND_S,
                   samples: list | None = None) -> dict:
    """Plain torchrun nodes (``launching.run_torchrun``'s), ``kind`` fired on node 1 by this
    bench at step ``FAULT_STEP``; stopped once it recovered, or ``bound_s`` after the fault."""
    from elastic_harness.chaos.vocabulary import parse_fault
    from elastic_harness.checkpoint.lock import Holder
    from elastic_harness.records.rundir import prepare
    from elastic_harness.simcluster.cluster import free_port
    from elastic_harness.spec import load_job

    spec = load_job(job, ["nproc_per_node=1"])
    if kind == "kill-node":  # fired by node 1's worker itself, as under the harness
        spec = dataclasses.replace(spec, chaos=[parse_fault(f"kill-node:1@{FAULT_STEP}")])
    port = free_port()
    rdzv_id = f"bench-{os.getpid()}-{port}"
    claim = prepare(run_dir, spec, holder=Holder.this_process(spec.name, rdzv_id))
    with claim:
        path = claim.path
        EventLog(path / runfiles.EVENTS).emit("start", who="host", launcher="torchrun", nodes=nodes)
        procs = []
        try:
            for i in range(nodes):
                cmd = torchrun_command(spec, path, 1, port, rdzv_id=rdzv_id)
                procs.append(_spawn(cmd, path / f"torchrun-{i}.log", torchrun_environ(os.environ, path, i)))
                if i == 0:
                    _wait_for_port(port, procs[0], 60)
            bound_hit = _follow(path, procs, kind, bound_s)
        finally:
            for p in procs:
                _signal_group(p, signal.SIGCONT)
                _signal_group(p, signal.SIGKILL)
                p.wait()
        codes = [p.returncode for p in procs]
    EventLog(path / runfiles.EVENTS).emit("exit", who="host", code=None, message="stopped by the bench")
    return measure(path, max(codes), bound_hit, samples)


def _follow(run_dir: Path, procs: list[subprocess.Popen], kind: str, bound_s: float,
            timeout_s: float = 600.0) -> float | None:
    """Fire a hang-node at step ``FAULT_STEP``; return once a step follows the fault at a
    smaller world size (recovered), or ``bound_s`` after it (returns ``bound_s``)."""
    tail, events = EventTail(run_dir / runfiles.EVENTS), EventLog(run_dir / runfiles.EVENTS)
    workers: dict[int, int] = {}  # rank -> pid of node 1's workers
    fault_t: float | None = None
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and any(p.poll() is None for p in procs):
        for e in tail.read():
            if e["event"] == "worker" and str(e.get("node")) == "1":
                workers[e["rank"]] = e["pid"]
            if e["event"] == "fault" and fault_t is None:
                fault_t = time.monotonic()
            if kind == "hang-node" and fault_t is None and e["event"] == "step" and e["step"] >= FAULT_STEP:
                fault_t = time.monotonic()
                _signal_group(procs[1], signal.SIGSTOP)
                for pid in workers.values():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGSTOP)
                events.emit("fault", kind="hang-node", target=1, step=e["step"], node="1",
                            detail=f"SIGSTOP torchrun node 1 (agent group and workers {sorted(workers.values())})")
            if fault_t is not None and e["event"] == "step" and e.get("world_size", 0) < len(procs) \
                    and e.get("pid") not in workers.values():
                time.sleep(0.5)  # a few more steps' events, then stop: the time is taken
                return None
        if fault_t is not None and time.monotonic() - fault_t > bound_s:
            return bound_s
        time.sleep(0.1)
    return None


# --- a spare ready ----------------------------------------------------------------------------

GOAL_SPARE_S = 1.0  # the goal: with a spare ready, the first step within 1 s at the same world size
SPARE_READY_S = 300.0


def bench_spare(scratch: Path, repeats: int, nodes: int) -> dict:
    """``nodes`` nodes and one spare (``nodes.spares``); once the spare waits in the
    redundancy list, node 1 is SIGKILLed (``chaos`` request); the run is stopped once a few
    steps followed. Recovery and the world size after it, per run."""
    job = _one_rank_per_node(write_job(scratch / "spare.yaml",
                                       BenchJob(steps=10**6, max_restarts=3, max_nodes=nodes, every=50)))
    runs = []
    for r in range(repeats):
        run_dir = scratch / f"spare-{nodes}-{r}"
        load = os.getloadavg()[0]
        code = spare_run(job, run_dir, nodes)
        result = measure(run_dir, code)
        result["same_world_size"] = result["world_size_after"] == nodes
        result["source"] = next((e.get("source") for e in reversed(read_events(run_dir / runfiles.EVENTS))
                                 if e["event"] == "resume"), None)
        runs.append({**result, "load": round(load, 2)})
    med = crash_stats.median_of([r["recovery_s"] for r in runs])
    return {"fault": "kill-node:1 once the spare waits", "nodes": nodes, "spares": 1, "nproc_per_node": 1,
            "median_s": med, "phases_median_s": crash_stats.median_breakdown([r["phases"] for r in runs if r["phases"]]),
            "same_world_size": sum(r["same_world_size"] for r in runs), "of": len(runs), "runs": runs,
            "goal": f"median <= {GOAL_SPARE_S} s at an unchanged world size (quiet machine)",
            "met": med is not None and med <= GOAL_SPARE_S and all(r["same_world_size"] for r in runs)}


def spare_run(job: Path, run_dir: Path, nodes: int, after_steps: int = 20) -> int | None:
    """One harness run with a spare: fault once it is ready, stop ``after_steps`` later."""
    from elastic_harness.chaos.inject import request

    cmd = [sys.executable, "-m", "elastic_harness", "run", str(job), "--run-dir", str(run_dir), "--nodes", str(nodes),
           "--nproc-per-node", "1", "--set", "nodes.spares=1"]
    run_dir.mkdir(parents=True, exist_ok=True)
    proc = _spawn(cmd, run_dir / "bench-host.log", dict(os.environ))
    tail = EventTail(run_dir / runfiles.EVENTS)
    spare, fired, stop_at = str(nodes), None, None
    end = time.monotonic() + SPARE_READY_S
    try:
        while proc.poll() is None and time.monotonic() < end:
            for e in tail.read():
                waiting = e["event"] == "torchelastic" and e.get("node") == spare \
                    and "redundancy list" in (e.get("message") or "")
                if waiting and fired is None:
                    fired = request(run_dir, "kill-node:1")
                if e["event"] == "fault" and stop_at is None:
                    stop_at = -1
                if e["event"] == "step" and stop_at == -1 and e.get("world_size") == nodes:
                    stop_at = e["step"] + after_steps
                if e["event"] == "step" and stop_at and stop_at > 0 and e["step"] >= stop_at:
                    end = 0.0
            time.sleep(0.1)
    finally:
        _signal_group(proc, signal.SIGINT)  # the host drains and stops its nodes
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            code = proc.wait()
    return code


# --- no false detections ------------------------------------------------------------------------

SOAK_ARGS = {"save_every": 300, "save_s": 20, "eval_every": 500, "eval_s": 8, "pause_every": 200, "pause_s": 3}


def bench_soak(scratch: Path, duration_s: float, jobs: int) -> dict:
    """``jobs`` jobs of 2 nodes x 1 rank at once for ``duration_s`` (the load is theirs), no
    fault injected, each with a 20 s synchronous save, a slow evaluation and an unannounced
    pause of one node (``soak_script``); every node-lost verdict or hang they report is a
    false detection."""
    script = Path(__file__).with_name("soak_script.py")
    procs, dirs, loads = [], [], []
    args = [str(v) for v in SOAK_ARGS.values()]
    for j in range(jobs):
        run_dir = scratch / f"soak-{j}"
        run_dir.mkdir(parents=True)
        cmd = [sys.executable, "-m", "elastic_harness", "run", "--run-dir", str(run_dir), "--nodes", "2",
               "--set", "nodes.min=1", "--set", "nodes.max=2", "--nproc-per-node", "1",
               "--set", "train.steps=10000000", "--set", "eval.batch_size=4", str(script), *args]
        procs.append(_spawn(cmd, run_dir / "bench-host.log", dict(os.environ)))
        dirs.append(run_dir)
    end = time.monotonic() + duration_s
    try:
        while time.monotonic() < end and all(p.poll() is None for p in procs):
            loads.append(os.getloadavg()[0])
            time.sleep(5)
    finally:
        for p in procs:
            _signal_group(p, signal.SIGINT)  # the host drains and stops its nodes
        for p in procs:
            try:
                p.wait(timeout=180)
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait()
    runs = [soak_counts(read_events(d / runfiles.EVENTS)) for d in dirs]
    false = sum(r["false_detections"] for r in runs)
    return {"duration_s": duration_s, "jobs": jobs, "nodes_per_job": 2, "script": SOAK_ARGS,
            "load_median": round(sorted(loads)[len(loads) // 2], 2) if loads else None,
            "load_max": round(max(loads), 2) if loads else None, "runs": runs,
            "false_detections": false, "goal": "0 false detections (no fault injected)", "met": false == 0}


def soak_counts(events: list[dict]) -> dict:
    """Pure: what a fault-free soak run reports: steps, saves and evaluations done, the stalls
    its agents looked at, and every verdict, hang or worker failure (false detections)."""
    failures = [e for e in events if e["event"] == "failure"]
    return {"steps": max((e["step"] for e in events if e["event"] == "step"), default=0),
            "evaluations": sum(1 for e in events if e["event"] == "eval"),
            "stalls_looked_at": sum(1 for e in events if e["event"] == "stall"),
            "node_lost": sum(1 for e in failures if e.get("cause") == "node-lost"),
            "hangs": sum(1 for e in failures if e.get("cause") == "hang"),
            "worker_failures": sum(1 for e in failures if not e.get("cause")),
            "false_detections": len(failures),
            "generations": sum(1 for e in events if e["event"] == "rendezvous")}
