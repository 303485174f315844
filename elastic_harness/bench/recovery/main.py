"""``elastic-harness bench recovery``: how fast a job recovers from faults, side by side.

Runs the same small MLP job under the harness (``elastic-harness run``) and under plain
``torchrun`` (``python -m torch.distributed.run``, c10d rendezvous, torch's default
rendezvous settings, our worker entry ``-m elastic_harness.runtime.entry JOB RUN_DIR``),
reads each run's ``events.jsonl`` with ``report.timeline``, and prints one JSON object
with medians, ratios and whether each goal was met:

- kill-node: SIGKILL one of ``--nodes`` (default 2) nodes (agent and workers;
  nodes.min=1), fault to the first completed step after it, harness / torchrun, medians of
  ``--repeats`` runs                                                              <= 0.03
  and steps redone per node loss (mean, durable saves every 50 steps)               <= 1
  with a row per placement (``bench.recovery.nodeloss``): every node on this host (``same_host``,
  the ratio above) and each node a simulated host of its own (``separate_hosts``: own
  pid, UTS and network namespaces, as root), each with its phases   separate <= 0.5 s
- in-place: node 1 of N SIGKILLed, N each of ``--sizes`` (default 2, 4, 8; 1 rank per node),
  recovered in place and by the warm restart (``recovery: restart``) in alternating runs, on
  each placement (``bench.recovery.inplace``), in place: 8 nodes / 2 nodes            <= 1.5
  the machine's CPU seconds from the fault to the first step, 8 nodes / 2 nodes       <= 2
  2 nodes, same host and separate hosts                                           <= 0.08 s
  every survivor kept its process (its pid the same after the fault), none fell back
- spare: ``--nodes`` nodes and one hot spare (``nodes.spares``); once the spare waits,
  node 1 is SIGKILLed: fault to the first step, at an unchanged world size        <= 1 s
- soak: ``--soak-jobs`` fault-free jobs at once for ``--soak-duration`` s, each with a 20 s
  synchronous save, a slow evaluation and an unannounced pause of one node
  (``bench.recovery.soak_script``): node-lost verdicts, hangs or failures they report       0
- hang-node: one of ``--nodes`` nodes frozen (SIGSTOP, no connection reset), the same rows
  and torchrun given the same fault; a launcher still not recovered 240 s after it is
  stopped there and reported so                                             <= 5 s
- kill-worker: SIGKILL one rank, same measure, harness (in place) / torchrun, median over
  ``--faults`` faults injected at different steps of one long run each (durable
  checkpoints every 50 steps), with the median of each recovery phase
  (``bench.recovery.crash_stats``), the harness with ``recovery: restart`` beside them   <= 0.03
  (the goals before in-place recovery: <= 0.25, stretch 0.10)
  every one of them recovered on the first try (harness), in place, with every survivor's
  process kept (``bench.recovery.kept``)                                             100 %
  and steps redone per crash (mean)                                                 <= 1
- anytime: ``--faults`` kill-worker faults sent by the host at seeded random moments
  (mid-step, mid-snapshot, mid-save) into one harness run: steps redone per crash
  (mean), and recovered on the first try                                  <= 1, 100 %
- memory-cost: ``--repeats`` uninterrupted runs probing the in-memory tier
  (``checkpoint.memory_probe``: off in every second block of 50 steps): median over
  neighbouring on/off block pairs of mean step time on / off - 1 (``report.probe``)  <= 3 %
  With ``--parallelism fsdp`` on 2 nodes x 1 rank, side by side in alternating runs: the
  tier without buddy copies (``checkpoint.memory_buddy=false``) and with them (the cost
  of snapshots and copies together, and the memory the copies take)                <= 3 %
- goodput with a seeded kill-worker about every 60 s over 5 minutes (``--long``; by
  default 1 fault every 20 s over 2 minutes, which says so in the JSON)          >= 0.97
- lost work: mean steps lost per kill <= 1 (the in-memory tier); 0 after a graceful drain
  (the run is ended by a preempt, then resumed to check that).
- scale-up: a node joining, arrival to the first step at the new size, from peers / from
  storage, medians of ``--repeats``; churn: goodput with a node killed and replaced every
  ``--churn-every`` s over ``--churn-duration`` s >= 0.98 (``bench.recovery.resize``).

What torchrun is given beyond its defaults, and why: the job's ``--nnodes`` (1:2 for
kill-node, 1:1 otherwise) and ``--max-restarts``, without which it survives no fault,
``ELASTIC_HARNESS_NODE`` so our step-keyed fault injector knows which node it is on, and a
``--log-dir`` in its run dir (and torch's compile cache there) so it leaves nothing in /tmp. It
does not get our tuning: short rendezvous timeouts, a private worker store
(``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``), the progress watchdog, warm starts and the
in-memory tier (they need our agent). Node 0 starts first so it hosts the c10d store, and
node 1 is the one killed (killing the store host ends the job).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
from pathlib import Path

from elastic_harness import runfiles
from elastic_harness.bench import check_out, cpuwindow, scratch_dir
from elastic_harness.bench.recovery import crash_stats, inplace, kept, nodeloss, resize
from elastic_harness.bench.recovery.launching import BenchJob, launch, log_tails, write_job
from elastic_harness.errors import HarnessError
from elastic_harness.events import read_events
from elastic_harness.report.probe import probe_cost
from elastic_harness.report.timeline import FaultRow, build, split_invocations

MIN_REPEATS_FOR_GOALS = 5
GOALS = {"kill_node_ratio": 0.03, "kill_worker_ratio": 0.25, "kill_worker_stretch": 0.10, "kill_worker_in_place": 0.03,
         "steps_redone": 1.0, "node_steps_redone": 1.0, "memory_cost": 0.03, "goodput": 0.97}
NODE_CKPT_EVERY = 50  # kill-node: the spec's default durable interval (memory covers it)
GOODPUT_CKPT_EVERY = 50
CRASH_CKPT_EVERY = 50  # durable interval of the worker-crash runs: memory covers the rest
ANYTIME_EVERY_S = 4.0  # about one host-sent kill this often in the anytime part
COST_STEPS, COST_WARMUP = 1000, 20  # memory-cost runs: steps (~10 s each: noise ~1/sqrt), and steps not measured
PROBE_BLOCK = 50  # memory-cost: steps per on/off block; one durable save in each (every 50)



PARTS = ["kill-node", "in-place", "hang-node", "spare", "soak", "kill-worker", "anytime", "memory-cost", "goodput",
         "scale-up", "churn"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("recovery", help="recovery time and goodput under faults, harness vs torchrun (JSON)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="kill-node runs per launcher; medians reported (default 5)")
    p.add_argument("--faults", type=int, default=20, help="kill-worker faults in the restart run (default 20)")
    p.add_argument("--soak-duration", type=float, default=600.0,
                   help="soak: seconds the fault-free jobs run (default 600)")
    p.add_argument("--soak-jobs", type=int, default=3,
                   help="soak: jobs at once, each 2 nodes x 1 rank (they load the machine) (default 3)")
    p.add_argument("--nodes", type=int, default=2,
                   help="kill-node and hang-node: nodes of 1 rank, node 1 is hit (default 2)")
    p.add_argument("--sizes", default="2,4,8",
                   help="in-place: the node counts compared, each in place and restarted (default 2,4,8)")
    p.add_argument("--long", action="store_true", help="goodput: 1 fault/60 s over 300 s (default 1/20 s over 120 s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the goodput fault schedule (default 0)")
    p.add_argument("--scale-up-hidden", type=int, default=256,
                   help="scale-up: the MLP's width (256: a 1.6 MB state; 2048: ~100 MB) (default 256)")
    p.add_argument("--churn-duration", type=float, default=600.0, help="churn: seconds the run lasts (default 600)")
    p.add_argument("--churn-every", type=float, default=120.0, help="churn: seconds between node kills (default 120)")
    p.add_argument("--churn-replace-after", type=float, default=10.0,
                   help="churn: seconds from a kill to its replacement's start (default 10)")
    p.add_argument("--parallelism", choices=["ddp", "fsdp"], default="ddp",
                   help="kill-node and memory-cost jobs: ddp (replicated: survivors' own snapshots) or fsdp "
                        "(sharded: buddy copies; memory-cost then on 2 nodes, with and without copies)")
    p.add_argument("--only", action="append", choices=PARTS,
                   help="run only these parts (repeatable; default all)")
    p.add_argument("--dir", help="scratch directory for run dirs (default: system temp; removed after)")
    p.add_argument("--keep", action="store_true", help="keep the run dirs (to run 'report' on them)")
    p.add_argument("--out", help="also write the JSON here")
    p.set_defaults(func=cmd_recovery)


def cmd_recovery(args: argparse.Namespace) -> int:
    if args.repeats < 1 or args.faults < 1 or args.scale_up_hidden < 1:
        raise HarnessError("--repeats, --faults and --scale-up-hidden must be >= 1")
    if args.soak_duration <= 0 or args.soak_jobs < 1:
        raise HarnessError("--soak-duration must be positive and --soak-jobs at least 1")
    if args.nodes < 2:
        raise HarnessError(f"--nodes {args.nodes}: a node loss needs a survivor", "pass --nodes 2 or more")
    try:
        sizes = inplace.parse_sizes(args.sizes)
    except ValueError as e:
        raise HarnessError(str(e), "pass --sizes as node counts of 2 or more, e.g. --sizes 2,4,8") from None
    if not 0 < args.churn_replace_after < args.churn_every < args.churn_duration:
        raise HarnessError("the churn needs 0 < --churn-replace-after < --churn-every < --churn-duration",
                           "e.g. --churn-duration 600 --churn-every 120 --churn-replace-after 10")
    parts = args.only or PARTS
    check_out(args.out)
    scratch = scratch_dir("eh-recovery-", args.dir)
    report: dict = {"bench": "recovery", "settings": _settings(args, parts, scratch)}
    try:
        if "kill-node" in parts:
            report["kill_node"] = bench_kill_node(scratch, args.repeats, args.parallelism, args.nodes)
        if "in-place" in parts:
            report["in_place"] = inplace.bench_in_place(scratch, args.repeats, sizes, args.parallelism)
        if "hang-node" in parts:
            report["hang_node"] = nodeloss.bench_node_fault(scratch, "hang-node", args.repeats, args.nodes,
                                                            args.parallelism)
        if "spare" in parts:
            report["spare"] = nodeloss.bench_spare(scratch, args.repeats, max(args.nodes, 2))
        if "soak" in parts:
            report["soak"] = nodeloss.bench_soak(scratch, args.soak_duration, args.soak_jobs)
        if "kill-worker" in parts:
            report["kill_worker"] = bench_kill_worker(scratch, args.faults)
        if "anytime" in parts:
            report["anytime"] = bench_anytime(scratch, args.faults, args.seed)
        if "memory-cost" in parts:
            report["memory_cost"] = (bench_buddy_cost(scratch, args.repeats) if args.parallelism == "fsdp"
                                     else bench_memory_cost(scratch, args.repeats))
        if "goodput" in parts:
            report["goodput"] = bench_goodput(scratch, args.long, args.seed)
        if "scale-up" in parts:
            report["scale_up"] = resize.bench_scale_up(scratch, args.repeats, args.scale_up_hidden)
        if "churn" in parts:
            report["churn"] = resize.bench_churn(scratch, args.churn_duration, args.churn_every,
                                                 args.churn_replace_after)
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    report["goals_met"] = goals_met(report, args.repeats)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


def _settings(args: argparse.Namespace, parts: list[str], scratch: Path) -> dict:
    duration, interval = (300, 60) if args.long else (120, 20)
    return {
        "parts": parts, "repeats": args.repeats, "parallelism": args.parallelism, "kill_worker_faults": args.faults,
        "nodes": args.nodes, "in_place_sizes": args.sizes,
        "goodput_mode": ("long" if args.long else "short (use --long for the goal's 1 fault/60 s over 5 min)"),
        "goodput_duration_s": duration, "goodput_fault_every_s": interval, "seed": args.seed,
        "churn_duration_s": args.churn_duration, "churn_every_s": args.churn_every,
        "churn_replace_after_s": args.churn_replace_after,
        "run_dirs": str(scratch) if args.keep else None, "cpu_count": os.cpu_count(),
        "torchrun": "python -m torch.distributed.run --rdzv-backend c10d --nnodes 1:2 (kill-node) or 1:1 "
                    "--max-restarts <job's> --log-dir <run dir>/logs, default rendezvous conf and worker store",
    }


# --- the three measurements ----------------------------------------------------------------


def bench_kill_node(scratch: Path, repeats: int, parallelism: str = "ddp", nodes: int = 2) -> dict:
    """Kill node 1 of ``nodes`` at step 40; harness (same host, and separate hosts where
    root: ``bench.recovery.nodeloss``) and torchrun runs alternate."""
    job = write_job(scratch / "kill-node.yaml",
                    BenchJob(steps=100, max_restarts=3, max_nodes=nodes, every=NODE_CKPT_EVERY,
                             parallelism=parallelism))
    launchers = ["harness", *(["separate_hosts"] if os.geteuid() == 0 else []), "torchrun"]
    out: dict[str, list] = {name: [] for name in launchers}
    skipped = 0
    for r in range(repeats):
        for launcher in launchers:
            if launcher == "torchrun" and nodeloss.gave_up(out["torchrun"]):
                skipped += 1
                continue
            run_dir = scratch / f"kill-node-{launcher}-{r}"
            load = round(os.getloadavg()[0], 2)
            with cpuwindow.Sampler() as cpu:
                if launcher == "separate_hosts":
                    code = nodeloss.harness(job, run_dir, nodes, "kill-node", separate=True)
                else:
                    code = launch(launcher, job, run_dir, nodes=nodes, nproc=1, chaos=["kill-node:1@40"], timeout=420)
            recovery = _one_recovery(run_dir, code)
            measured = nodeloss.measure(run_dir, code, samples=cpu.samples)
            out[launcher].append({**recovery, "load": load, "cpu_busy": measured["cpu_busy"],
                                  "cpu_s": measured["cpu_s"], "phases": measured["phases"],
                                  **{k: measured.get(k) for k in kept.of_fault(None)},
                                  # stopped by the bench (no progress for launching.STALL_S, or past 420 s)
                                  "stopped_at_bound": code is None})
    separate = out.pop("separate_hosts", None)
    result = _compare(out, GOALS["kill_node_ratio"])
    result["nodes"] = nodes
    result["torchrun_stopped_at_bound"] = sum(r["stopped_at_bound"] for r in out["torchrun"])  # never recovered
    result.update(nodeloss.skipped_note(skipped))
    result["rows"] = {"same_host": nodeloss.summarize(out["harness"], out["torchrun"]),
                      "separate_hosts": (nodeloss.summarize(separate, out["torchrun"]) if separate is not None
                                         else {"skipped": "needs root (network, pid and UTS namespaces)"})}
    result["separate_hosts_goal"] = nodeloss.goals("kill-node", result["rows"])
    lost = [r["steps_lost"] for r in out["harness"] if r.get("steps_lost") is not None]
    result["steps_redone_mean"] = round(sum(lost) / len(lost), 2) if lost else None
    result["steps_redone_goal"] = f"mean <= {GOALS['node_steps_redone']} (durable saves every {NODE_CKPT_EVERY})"
    result["steps_redone_met"] = bool(lost) and sum(lost) / len(lost) <= GOALS["node_steps_redone"]
    result["steps_redone_median"] = crash_stats.median_of(lost)
    result["steps_redone"] = [r.get("steps_lost") for r in out["harness"]]
    result["tier_before_fault"] = [r.get("tier") for r in out["harness"]]
    result["parallelism"] = parallelism
    result["restore_sources"] = [r.get("source") for r in out["harness"]]
    return result


KILL_WORKER_SIDES = {"harness": ("harness", []), "restart": ("harness", ["recovery=restart"]),
                     "torchrun": ("torchrun", [])}  # side -> (launcher, --set)


def bench_kill_worker(scratch: Path, faults: int) -> dict:
    """One long run per side with ``faults`` kill-worker faults at different steps: the
    harness (in place, the default), the harness restarting every worker (``recovery:
    restart``) and torchrun; every fault's survivors that kept their process (``kept``)."""
    schedule = kill_worker_schedule(faults, CRASH_CKPT_EVERY)
    steps = faults * CRASH_CKPT_EVERY + 2 * CRASH_CKPT_EVERY
    job = write_job(scratch / "kill-worker.yaml",
                    BenchJob(steps=steps, max_restarts=faults + 10, every=CRASH_CKPT_EVERY))
    out: dict[str, dict] = {}
    for side, (launcher, sets) in KILL_WORKER_SIDES.items():
        run_dir = scratch / f"kill-worker-{side}"
        load = round(os.getloadavg()[0], 2)
        code = launch(launcher, job, run_dir, nodes=1, nproc=2, chaos=schedule, timeout=faults * 45 + 240, sets=sets)
        out[side] = {**crash_stats.crash_summary(read_events(run_dir / runfiles.EVENTS), faults, code), "load": load}
        if code != 0:  # the scratch dir goes unless --keep: keep what says why in the JSON
            out[side]["log_tails"] = log_tails(run_dir)
    theirs = out["torchrun"]["median_recovery_s"]
    ratio = _ratio(out["harness"]["median_recovery_s"], theirs)
    h = out["harness"]
    return {
        **out, "ratio": ratio, "restart_ratio": _ratio(out["restart"]["median_recovery_s"], theirs),
        "in_place_over_restart": _ratio(h["median_recovery_s"], out["restart"]["median_recovery_s"]),
        "checkpoint_every_steps": CRASH_CKPT_EVERY,
        "goal": (f"ratio (in place) <= {GOALS['kill_worker_in_place']} (earlier goals {GOALS['kill_worker_ratio']}, "
                 f"stretch {GOALS['kill_worker_stretch']}), all {faults} recovered on the first try, in place with "
                 f"every survivor's process kept, mean steps redone <= {GOALS['steps_redone']}"),
        "met": {
            "in_place_ratio": ratio is not None and ratio <= GOALS["kill_worker_in_place"],
            "ratio": ratio is not None and ratio <= GOALS["kill_worker_ratio"],
            "stretch": ratio is not None and ratio <= GOALS["kill_worker_stretch"],
            "first_try": h["recovered_first_try"] == faults,
            "every_survivor_kept": h["kept"]["in_place"] == faults and bool(h["kept"]["every_survivor_kept"]),
            "no_fall_back": h["kept"]["fell_back"] == 0,
            "steps_redone": h["mean_steps_lost"] is not None and h["mean_steps_lost"] <= GOALS["steps_redone"],
        },
    }


def bench_anytime(scratch: Path, faults: int, seed: int) -> dict:
    """Host-sent kills at seeded random moments of one harness run, then a drain ends it."""
    duration = ANYTIME_EVERY_S * (faults + 1)
    job = write_job(scratch / "anytime.yaml",
                    BenchJob(steps=10**7, max_restarts=faults + 10, every=CRASH_CKPT_EVERY))
    run_dir = scratch / "anytime"
    schedule = goodput_schedule(duration, ANYTIME_EVERY_S, seed, ranks=2)
    code = launch("harness", job, run_dir, nodes=1, nproc=2, chaos=schedule, timeout=int(duration) + 300)
    stats = crash_stats.crash_summary(read_events(run_dir / runfiles.EVENTS), faults, code, kinds=("kill-worker",))
    return {
        **stats, "schedule": schedule, "checkpoint_every_steps": CRASH_CKPT_EVERY,
        "goal": f"mean steps redone <= {GOALS['steps_redone']}, all recovered on the first try",
        "met": {"steps_redone": stats["mean_steps_lost"] is not None
                and stats["mean_steps_lost"] <= GOALS["steps_redone"],
                "first_try": stats["recovered_first_try"] == stats["fired"] > 0},
    }


def bench_memory_cost(scratch: Path, repeats: int) -> dict:
    """``repeats`` uninterrupted runs probing the in-memory tier (``checkpoint.memory_probe``):
    blocks of ``PROBE_BLOCK`` steps with it on and off alternate inside each run, and each
    block is compared with its neighbours (``report.probe``)."""
    job = write_job(scratch / "memory-cost.yaml",
                    BenchJob(steps=COST_STEPS, max_restarts=0, hidden=256, depth=3, batch=64, micro=32,
                             every=CRASH_CKPT_EVERY))
    runs = []
    for r in range(repeats):
        run_dir = scratch / f"memory-cost-{r}"
        code = launch("harness", job, run_dir, nodes=1, nproc=2, chaos=[], timeout=600,
                      sets=["checkpoint.memory_every=1", f"checkpoint.memory_probe={PROBE_BLOCK}"])
        events = read_events(run_dir / runfiles.EVENTS)
        probe = probe_cost(events, skip=COST_WARMUP)
        runs.append({"exit": code, "cost": probe.cost if probe else None, "pairs": probe.pairs if probe else [],
                     "on_step_s": probe.on_step_s if probe else None,
                     "off_step_s": probe.off_step_s if probe else None,
                     "copy_share": crash_stats.copy_share(events)})
    pairs = [p for run in runs for p in run["pairs"]]
    cost = round(statistics.median(pairs), 4) if pairs else None
    return {
        "runs": runs, "cost": cost, "pairs": len(pairs),
        "pairs_p25_p75": crash_stats.quartiles(pairs),
        "copy_share": crash_stats.median_of([x["copy_share"] for x in runs]),
        "memory_every": 1, "memory_budget": "the job's (default 0.03)", "probe_block_steps": PROBE_BLOCK,
        "steps": COST_STEPS, "warmup_steps": COST_WARMUP,
        "method": ("in-run probe: the tier is off in every second block of steps; cost = median over "
                   "neighbouring on/off block pairs of all runs of mean(on) / mean(off) - 1"),
        "goal": f"cost <= {GOALS['memory_cost']}", "met": cost is not None and cost <= GOALS["memory_cost"],
    }


def bench_buddy_cost(scratch: Path, repeats: int) -> dict:
    """FSDP on 2 nodes x 1 rank, the in-memory tier probed (as ``bench_memory_cost``) in
    alternating runs without and with buddy copies: two rows side by side, the same minutes
    of the machine. The ``with_copies`` row's cost is snapshots and copies together."""
    job = write_job(scratch / "buddy-cost.yaml",
                    BenchJob(steps=COST_STEPS, max_restarts=0, max_nodes=2, hidden=256, depth=3, batch=64,
                             micro=32, every=CRASH_CKPT_EVERY, parallelism="fsdp"))
    rows: dict[str, list] = {"own_only": [], "with_copies": []}
    for r in range(repeats):
        for name, copies in (("own_only", "false"), ("with_copies", "true")):
            rows[name].append(_buddy_cost_run(job, scratch / f"buddy-cost-{name}-{r}", copies))
    out: dict = {"parallelism": "fsdp", "nodes": 2, "nproc_per_node": 1, "probe_block_steps": PROBE_BLOCK,
                 "steps": COST_STEPS, "warmup_steps": COST_WARMUP, "memory_every": 1}
    for name, runs in rows.items():
        pairs = [p for run in runs for p in run["pairs"]]
        out[name] = {"cost": round(statistics.median(pairs), 4) if pairs else None, "pairs": len(pairs),
                     "pairs_p25_p75": crash_stats.quartiles(pairs), "runs": runs}
    sizes = [run["copy_bytes"] for run in rows["with_copies"] if run["copy_bytes"]]
    out["copy_bytes_per_rank"] = max(sizes) if sizes else None
    out["copy_memory_bound_per_rank"] = 2 * max(sizes) if sizes else None  # two buddy slots
    cost = out["with_copies"]["cost"]
    out["cost"] = cost
    own = out["own_only"]["cost"]
    out["copies_cost"] = None if cost is None or own is None else round(cost - own, 4)  # what the copies add
    out["method"] = ("in-run probe (the tier, copies included, off in every second block): median over "
                     "neighbouring on/off block pairs of mean(on) / mean(off) - 1; rows alternate runs")
    # The goal is what the copies cost (the own snapshots have theirs, ``memory_cost``
    # under DDP): each within the tier's budget, a budget apiece.
    out["goal"] = f"copies_cost <= {GOALS['memory_cost']}"
    out["met"] = out["copies_cost"] is not None and out["copies_cost"] <= GOALS["memory_cost"]
    return out


def _buddy_cost_run(job: Path, run_dir: Path, copies: str) -> dict:
    """One probed run of ``bench_buddy_cost``, buddy copies on (``copies`` "true") or off."""
    code = launch("harness", job, run_dir, nodes=2, nproc=1, chaos=[], timeout=600,
                  sets=["checkpoint.memory_every=1", f"checkpoint.memory_probe={PROBE_BLOCK}",
                        f"checkpoint.memory_buddy={copies}"])
    events = read_events(run_dir / runfiles.EVENTS)
    probe = probe_cost(events, skip=COST_WARMUP)
    copy_events = [e for e in events if e["event"] == "buddy"]
    tier = [e for e in events if e["event"] == "memory" and e.get("copy_s") and e.get("every")]  # not probe-off
    return {"exit": code, "cost": probe.cost if probe else None, "pairs": probe.pairs if probe else [],
            "copy_bytes": copy_events[0]["bytes"] if copy_events else None,
            # the tier's last measured figures: snapshot and copy intervals and costs
            "tier": tier_before([*tier, {"event": "fault"}]) if tier else None}


def bench_goodput(scratch: Path, long: bool, seed: int) -> dict:
    """Seeded kill-worker faults until a graceful preempt ends the run; then resume it."""
    duration, interval = (300.0, 60.0) if long else (120.0, 20.0)
    job = write_job(scratch / "goodput.yaml",
                    BenchJob(steps=10**7, max_restarts=100, hidden=256, depth=3, batch=64, micro=32,
                             every=GOODPUT_CKPT_EVERY))
    run_dir = scratch / "goodput"
    schedule = goodput_schedule(duration, interval, seed, ranks=2)
    first = launch("harness", job, run_dir, nodes=1, nproc=2, chaos=schedule, timeout=int(duration) + 300)
    drains = [e for e in read_events(run_dir / runfiles.EVENTS) if e["event"] == "drain"]
    second = None
    if drains:  # resume a few steps past the drain: proves the drain lost nothing
        second = launch("harness", job, run_dir, nodes=1, nproc=2, chaos=[], timeout=240,
                        sets=[f"train.steps={drains[-1]['step'] + 5}"])
    events = read_events(run_dir / runfiles.EVENTS)
    return goodput_result(events, schedule, (first, second), GOODPUT_CKPT_EVERY)


# --- pure pieces: schedules and summaries ---------------------------------------------------


def kill_worker_schedule(n: int, every: int) -> list[str]:
    """``n`` kill-worker faults, alternating ranks, at different points of the save interval."""
    return [f"kill-worker:{i % 2}@{(i + 1) * every + 1 + (i * 3) % (every - 1)}" for i in range(n)]


def goodput_schedule(duration: float, interval: float, seed: int, ranks: int) -> list[str]:
    """A kill-worker about every ``interval`` s (seeded jitter, rank), then a preempt at ``duration``."""
    rng = random.Random(seed)
    out = []
    t = interval
    while t < duration - interval / 2:
        at = t + rng.uniform(-0.25, 0.25) * interval
        out.append(f"kill-worker:{rng.randrange(ranks)}@{at:.1f}s")
        t += interval
    return [*out, f"preempt:0@{duration:.1f}s"]


def _one_recovery(run_dir: Path, code: int | None) -> dict:
    events = read_events(run_dir / runfiles.EVENTS)
    rows = build(events).faults
    row = rows[0] if rows else None
    return {
        "exit": code, "fired": bool(rows), "recovery_s": row.recovery_s if row else None,
        "detect_s": _since(row, row.detected) if row else None,
        "rendezvous_s": _since(row, row.rendezvous) if row else None,
        "loaded_s": _since(row, row.loaded) if row else None,
        "steps_lost": row.steps_lost if row else None,
        "finished": any(e["event"] == "finish" for e in events),
        "source": next((e.get("source") for e in reversed(events) if e["event"] == "resume"), None),
        "tier": tier_before(events),
    }


def tier_before(events: list[dict]) -> dict | None:
    """The in-memory tier's intervals in force at the first fault (rank 0's last ``memory``
    event before it): snapshots and buddy copies every how many steps, and the times they
    came from."""
    fault = next((i for i, e in enumerate(events) if e["event"] == "fault"), None)
    last = None if fault is None else next(
        (e for e in reversed(events[:fault]) if e["event"] == "memory"), None)
    if last is None:
        return None
    return {"snapshot_every": last.get("every"), "copy_every": last.get("copy_every"),
            "snapshot_ms": round(1e3 * (last.get("copy_s") or 0), 3),
            "copy_cost_ms": None if last.get("copy_cost_s") is None else round(1e3 * last["copy_cost_s"], 3),
            "step_ms": round(1e3 * (last.get("step_s") or 0), 3)}


def _since(row: FaultRow, t: float | None) -> float | None:
    return None if t is None else round(t - row.t, 3)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _compare(out: dict[str, list], goal: float) -> dict:
    med = {k: crash_stats.median_of([r["recovery_s"] for r in v]) for k, v in out.items()}
    ratio = _ratio(med["harness"], med["torchrun"])
    return {
        "harness_median_s": med["harness"], "torchrun_median_s": med["torchrun"], "ratio": ratio,
        "goal": f"ratio <= {goal}", "met": ratio is not None and ratio <= goal,
        "runs": out,
    }


def goodput_result(events: list[dict], schedule: list[str], codes: tuple, every: int) -> dict:
    """Goodput of the faulted invocation; lost work per kill and across the drain."""
    invocations = split_invocations(events)
    faulted = build(invocations[0]) if invocations else build([])
    rows = build(events).faults
    kills = [f for f in rows if f.kind == "kill-worker"]
    drains = [f for f in rows if f.kind == "preempt"]
    mean_lost = crash_stats.mean_of([f.steps_lost for f in kills])
    lost_goal = GOALS["steps_redone"]
    g = faulted.goodput
    return {
        "schedule": schedule, "exit_codes": list(codes), "wall_s": g.wall_s, "productive_s": g.productive_s,
        "goodput": g.goodput, "badput_s": g.badput, "faults_fired": len(rows),
        "median_recovery_s": crash_stats.median_of([f.recovery_s for f in kills]),
        "steps_lost_per_kill": [f.steps_lost for f in kills], "mean_steps_lost_per_kill": mean_lost,
        "steps_lost_after_drain": [f.steps_lost for f in drains], "checkpoint_every_steps": every,
        "goal": f"goodput >= {GOALS['goodput']}; mean steps lost per kill <= {lost_goal}; 0 after a drain",
        "met": {
            "goodput": g.goodput >= GOALS["goodput"],
            "lost_work": mean_lost is not None and mean_lost <= lost_goal,
            "graceful_lost_zero": bool(drains) and all(f.steps_lost == 0 for f in drains),
        },
    }


def goals_met(report: dict, repeats: int) -> dict:
    out = {}
    if "kill_node" in report:
        out["kill_node_ratio"] = report["kill_node"]["met"]
        out["kill_node_steps_redone"] = report["kill_node"].get("steps_redone_met", False)
        if "separate_hosts_goal" in report["kill_node"]:
            out["kill_node_separate_hosts"] = report["kill_node"]["separate_hosts_goal"]["met"]
    if "in_place" in report:
        out["in_place"] = report["in_place"]["met"]
        out["in_place_goals"] = {k: g["met"] for k, g in report["in_place"]["goals"].items()}
    if "hang_node" in report:
        out["hang_node"] = report["hang_node"]["met"]
    if "spare" in report:
        out["spare"] = report["spare"]["met"]
    if "soak" in report:
        out["soak_no_false_detection"] = report["soak"]["met"]
    for part in ("kill_worker", "anytime"):
        if part in report:
            out.update({f"{part}_{k}": v for k, v in report[part]["met"].items()})
    if "memory_cost" in report:
        out["memory_cost"] = report["memory_cost"]["met"]
    if "goodput" in report:
        out.update({f"goodput_{k}": v for k, v in report["goodput"]["met"].items()})
    if "scale_up" in report:
        out["scale_up_no_storage_read"] = report["scale_up"]["no_storage_read"]
    if "churn" in report:
        out["churn_goodput"] = report["churn"]["met"]
    if repeats < MIN_REPEATS_FOR_GOALS and any(k in report for k in ("kill_node", "in_place", "scale_up")):
        out["note"] = (f"--repeats {repeats} < {MIN_REPEATS_FOR_GOALS}: kill-node, in-place and scale-up medians "
                       "are indicative only")
    return out
