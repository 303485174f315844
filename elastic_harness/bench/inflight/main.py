"""``elastic-harness bench inflight``: a node lost in the middle of training, the harness
beside torchft 0.2.0, in one run.

Both sides train the same job (``bench.inflight.job``: jobs/mlp.yaml's MLP and data, a global
batch of 30 in micro-batches of at most 8, 100 steps) on ``--groups`` nodes of one process
(the harness) or replica groups of one process (torchft), and lose node / group 1:

- by default right after its step 40 (harness: ``kill-node:1@40``; torchft: the group
  SIGKILLs itself once its step 40 commits);
- ``--in-step``: inside step 41's gradient reduction (harness: ``kill-node:1@40+reduction``;
  torchft: once step 41's quorum holds the group, before its all-reduce). torchft runs twice
  then: as shipped (``torchft``) and with the comm hook of ``torchcompat.ftddp``
  (``torchft_patched``), since torchft 0.2.0's own hook fails the healthy groups there.

Runs alternate (repeat r: harness first when r is even, torchft first when odd), so load
drift hits both sides. Per run and side (``harness_side``, ``torchft_stats``):

- micro-batches discarded on healthy ranks (computed for a step that was then thrown away);
- the healthy ranks' longest gap between two committed steps during the loss (the gap the
  fault falls in and the next: ``gaps``), beside the whole run's and the median step time;
- steps redone;
- whether every step's update was over the whole global batch.

Goals, on the harness's medians over ``--repeats``: discarded 0, steps redone 0, longest gap
<= 2 median step times + 50 ms, global batch held in every run. torchft is optional
(``pip install torchft==0.2.0``): without it that side says why it was skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
from pathlib import Path

from elastic_harness.bench import check_out, scratch_dir
from elastic_harness.bench.inflight import job
from elastic_harness.errors import HarnessError

GAP_STEPS, GAP_SLACK_S = 2, 0.05  # the gap goal: 2 median step times + 50 ms
INSTALL = "pip install torchft==0.2.0"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inflight", help="a node lost mid-training: the harness vs torchft 0.2.0 (JSON)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="runs per side; medians reported (default 3)")
    p.add_argument("--groups", type=int, choices=(2, 3), default=2,
                   help="nodes (harness) and replica groups (torchft) of one process each (default 2)")
    p.add_argument("--in-step", action="store_true",
                   help="lose the node inside step 41's gradient reduction, not after step 40")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per run (default 300)")
    p.add_argument("--dir", help="scratch directory (default: system temp; removed after)")
    p.add_argument("--keep", action="store_true", help="keep the run dirs and logs")
    p.add_argument("--out", help="also write the JSON here")
    p.set_defaults(func=cmd_inflight)


def cmd_inflight(args: argparse.Namespace) -> int:
    if args.repeats < 1 or args.timeout <= 0:
        raise HarnessError("--repeats must be >= 1 and --timeout positive", "e.g. --repeats 3 --timeout 300")
    check_out(args.out)
    sides = sides_to_run(args.in_step)
    scratch = scratch_dir("eh-inflight-", args.dir)
    load_before = os.getloadavg()
    try:
        runs = run_all(scratch, sides, args)
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    report = summarize(runs, sides)
    report = {"bench": "inflight", "settings": settings(args, sides, scratch),
              "load_average": {"before": [round(x, 2) for x in load_before],
                               "after": [round(x, 2) for x in os.getloadavg()]}, **report}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


def sides_to_run(in_step: bool) -> dict[str, str | None]:
    """side -> None (it runs) or the one-line reason it is skipped."""
    try:
        import torchft  # noqa: F401
        missing = None
    except ImportError:
        missing = f"torchft is not installed here ({INSTALL})"
    return {"harness": None, "torchft": missing, **({"torchft_patched": missing} if in_step else {})}


def run_all(scratch: Path, sides: dict[str, str | None], args: argparse.Namespace) -> dict[str, list[dict]]:
    """Every repeat of every side that runs, alternating which side goes first."""
    live = [s for s, skipped in sides.items() if skipped is None]
    runs: dict[str, list[dict]] = {s: [] for s in live}
    for r in range(args.repeats):
        for side in live if r % 2 == 0 else live[::-1]:
            load = round(os.getloadavg()[0], 2)
            out = run_side(side, scratch / f"{side}-{r}", args)
            runs[side].append({**out, "load": load})
    return runs


def run_side(side: str, run_dir: Path, args: argparse.Namespace) -> dict:
    """One run of ``side`` (imported here: ``--help`` must not import torch)."""
    if side == "harness":
        from elastic_harness.bench.inflight import harness_side

        return harness_side.run(run_dir, groups=args.groups, steps=job.STEPS, kill_at=job.KILL_AT,
                                in_step=args.in_step, timeout_s=args.timeout)
    from elastic_harness.bench.inflight import torchft_run

    cfg = torchft_run.Config(groups=args.groups, steps=job.STEPS, kill_group=1, kill_at_step=job.KILL_AT,
                             kill_point="in_step" if args.in_step else "after_step",
                             patch_ddp_hook=side == "torchft_patched")
    try:
        return torchft_run.run(run_dir, cfg, args.timeout)
    except RuntimeError as e:  # a process ended before training started: the row says so
        return {"row": {"verdict": f"did not start: {e}"}}


def median(values: list) -> float | None:
    kept = [v for v in values if v is not None]
    return round(statistics.median(kept), 4) if kept else None


def side_row(runs: list[dict]) -> dict:
    """A side's row: medians of each figure over its runs, and each run's verdict."""
    rows = [r["row"] for r in runs]
    keys = ("discarded_micro_batches", "longest_gap_s", "longest_gap_anywhere_s", "median_step_s", "steps_redone")
    return {**{k: median([r.get(k) for r in rows]) for k in keys},
            "global_batch_held": bool(rows) and all(r.get("global_batch_held") for r in rows),
            "verdicts": [r["verdict"] for r in rows], "runs": len(rows),
            "loads": [r["load"] for r in runs]}


def goals(row: dict) -> dict:
    """The harness's goals, judged on its medians."""
    gap, step = row["longest_gap_s"], row["median_step_s"]
    bound = round(GAP_STEPS * step + GAP_SLACK_S, 4) if step is not None else None
    return {"discarded_zero": row["discarded_micro_batches"] == 0, "steps_redone_zero": row["steps_redone"] == 0,
            "gap_bound_s": bound, "gap_within_bound": gap is not None and bound is not None and gap <= bound,
            "global_batch_held": row["global_batch_held"]}


def summarize(runs: dict[str, list[dict]], sides: dict[str, str | None]) -> dict:
    rows = {side: ({"skipped": why} if why else side_row(runs[side])) for side, why in sides.items()}
    met = goals(rows["harness"])
    met["all"] = all(v for k, v in met.items() if k != "gap_bound_s")
    return {"rows": rows, "goals": met, "runs": {side: [detail(side, r) for r in rs] for side, rs in runs.items()}}


def detail(side: str, run: dict) -> dict:
    """What a run's JSON keeps beyond its row (its scratch paths and per-group lists go)."""
    drop = {"row", "per_group", "per_rank"}
    return {k: v for k, v in run.items() if k not in drop}


def settings(args: argparse.Namespace, sides: dict[str, str | None], scratch: Path) -> dict:
    from elastic_harness.torchcompat.ftddp import PRIVATE_NAMES

    fault = f"kill-node:1@{job.KILL_AT}" + ("+reduction" if args.in_step else "")
    return {"repeats": args.repeats, "groups": args.groups, "steps": job.STEPS, "kill_at": job.KILL_AT,
            "in_step": args.in_step, "global_batch": job.GLOBAL_BATCH, "micro_batch": job.MICRO_BATCH,
            "model": {**job.TASK_ARGS, "optimizer": "adamw", "lr": job.LR},
            "harness": f"elastic-harness run JOB --nodes {args.groups} --nproc-per-node 1 (nodes.min=1, "
                       f"nodes.max={args.groups}) --set train.record_samples=true --chaos {fault}",
            "torchft": ("lighthouse (heartbeat timeout 5000 ms, join timeout 10000 ms, quorum tick 100 ms, "
                        "min replicas 1) + per group Manager (min_replica_size 1, init_sync False, "
                        "PGTransport), ProcessGroupGloo (5 s), torchft DDP, OptimizerWrapper(AdamW)"),
            "torchft_patched_uses": list(PRIVATE_NAMES) if "torchft_patched" in sides else None,
            "run_dirs": str(scratch) if args.keep else None, "cpu_count": os.cpu_count()}
