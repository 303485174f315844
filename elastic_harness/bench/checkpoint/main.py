"""``elastic-harness bench checkpoint``: how much checkpointing costs, side by side, in one run.

Spawns three processes with ``torch.multiprocessing`` on loopback gloo (a port from the OS);
see ``checkpoint.ranks`` and ``checkpoint.train`` for what each measures. Prints one JSON object: the
median of every measurement over ``--repeats`` (>= 5 for the goals to count), the ratios
the goals are stated in, and whether each goal was met:

- async save blocking time / sync DCP save time of the same state          <= 0.15
- sync save throughput / raw write bandwidth (same disk, same fsyncs)      >= 0.8
- load resharded 2 -> 3 processes / same-layout load 2 -> 2                <= 1.5
- load into another layout (rows saved by 2 ranks, columns loaded: FSDP2 shards to a
  tensor-parallel split) / same-layout load 2 -> 2                          <= 1.5
- step-time overhead of training with an async save every N steps          <= 3 %

Beside that overhead, the same run measures two floors (``checkpoint.floor``): a low-priority
thread writing the same number of raw bytes + fsync every N steps, with ``O_DIRECT`` and
through the page cache, no DCP. ``ratios.async_save_over_floor_direct`` says how far above
that floor the harness is; ``overhead_spread`` gives the quartiles of each kind's overhead
over the windows, each window paired with the no-save window of the same round.
``extra_cpu_s_per_save`` is the CPU each save adds to the ranks (all their threads);
``machine_s_per_save`` what it adds to the whole machine's time, by kind (user, kernel,
idle, iowait, steal: on a VM, a durable write also costs host time taken from the VM's CPUs).
``--train-only`` skips the save and load measurements.

The seeds' approach (rank 0 ``torch.save`` of the full state + barrier, every rank
``torch.load``s it) is measured alongside as the baseline. Loads read from disk: our own
files are evicted from the page cache first (``posix_fadvise``; nothing global).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import time
from pathlib import Path

from elastic_harness.bench import check_out, scratch_dir, spawning_into
from elastic_harness.errors import HarnessError

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}
MIN_REPEATS_FOR_GOALS = 5


def parse_size(text: str) -> int:
    """'64MB' -> 67108864 (K/M/G are powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise HarnessError(f"--size '{text}' is not a size", "write e.g. 64MB or 1GB")
    size = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if size < 1 << 20:
        raise HarnessError(f"--size {text} is below 1MB", "use at least 1MB")
    return size


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("checkpoint", help="checkpoint save/load/async/overhead benchmark (JSON)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="64MB", help="state size: weights + 2 optimizer moments (default 64MB)")
    p.add_argument("--repeats", type=int, default=5, help="repeats per measurement; medians reported (default 5)")
    p.add_argument("--every", type=int, default=10, help="training: save every N steps (default 10)")
    p.add_argument("--steps", type=int, default=10,
                   help="training: steps per timed window (default 10: one save interval per window, "
                        "so each is paired with a no-save window seconds away)")
    p.add_argument("--windows", type=int, default=30,
                   help="training: timed windows per kind, interleaved (default 30)")
    p.add_argument("--train-only", action="store_true", help="only the training overhead and its floors")
    p.add_argument("--dir", help="scratch directory on the disk to measure (default: system temp)")
    p.add_argument("--out", help="also write the JSON here")
    p.set_defaults(func=cmd_checkpoint)


def cmd_checkpoint(args: argparse.Namespace) -> int:
    if args.repeats < 1 or args.windows < 1 or args.every < 1 or args.steps < args.every:
        raise HarnessError("--repeats, --windows and --every must be >= 1 and --steps >= --every")
    size = parse_size(args.size)
    check_out(args.out)
    scratch = scratch_dir("eh-bench-", args.dir)
    try:
        raw = measure(size, args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report = summarize(raw, size, args)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


def threads_per_rank(cpus: int) -> int:
    """Compute threads for each of the 2 training ranks, leaving each one core for its
    background checkpoint thread where there are cores to spare (as a GPU job would)."""
    return max(1, cpus // 2 - 1) if cpus >= 6 else max(1, cpus // 2)


def measure(size: int, args: argparse.Namespace, scratch: Path) -> dict:
    import torch.multiprocessing as mp

    from elastic_harness.bench.checkpoint.ranks import main
    from elastic_harness.simcluster.cluster import free_port
    cfg = {"port": free_port(), "size": size, "repeats": args.repeats, "every": args.every,
           "steps": args.steps, "windows": args.windows, "train_only": args.train_only,
           "dir": str(scratch), "threads": threads_per_rank(os.cpu_count() or 1)}
    t0 = time.perf_counter()
    load_before = os.getloadavg()[0]
    with spawning_into(scratch):  # the ranks' torch caches and traceback files: in scratch
        ranks = mp.spawn(main, args=(cfg,), nprocs=3, join=False)
        try:
            while not ranks.join():
                pass
        except BaseException:  # a failed rank, or Ctrl-C: stop the others before the scratch goes
            stop_ranks(ranks.processes)
            raise
    raw = json.loads((scratch / "results.json").read_text())
    raw["wall_s"] = time.perf_counter() - t0
    raw["load_before"], raw["load_after"] = round(load_before, 2), round(os.getloadavg()[0], 2)
    return raw


def stop_ranks(processes: list, grace_s: float = 10.0) -> None:
    """SIGTERM the bench's rank processes still running, SIGKILL those that outlive
    ``grace_s``, and reap them all."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def _goal(value: float, target: float, higher_is_better: bool, enough: bool) -> dict:
    met = value >= target if higher_is_better else value <= target
    return {"value": round(value, 4), "target": (">= " if higher_is_better else "<= ") + str(target),
            "met": bool(met and enough)}


_RATIOS = {  # name: (numerator, denominator, minus one)
    "async_blocking_over_sync_save": ("async_blocking", "dcp_sync_save", False),
    "sync_save_over_raw_write_throughput": ("raw_write", "dcp_sync_save", False),
    "dcp_only_over_raw_write_throughput": ("raw_write", "dcp_only_sync_save", False),
    "resharded_load_over_same_layout": ("load_resharded_2to3", "load_same_layout_2to2", False),
    "layout_change_load_over_same_layout": ("load_layout_change_2to2", "load_same_layout_2to2", False),
    "step_overhead_async_save": ("step_async_save", "step_no_save", True),
    "step_overhead_sync_save": ("step_sync_save", "step_no_save", True),
    "step_overhead_floor_direct": ("step_floor_direct", "step_no_save", True),
    "step_overhead_floor_buffered": ("step_floor_buffered", "step_no_save", True),
    "async_save_over_floor_direct": ("step_async_save", "step_floor_direct", True),
    "baseline_save_over_sync_save": ("baseline_save", "dcp_sync_save", False),
    "baseline_save_over_async_blocking": ("baseline_save", "async_blocking", False),
    "baseline_load_over_same_layout_load": ("baseline_load", "load_same_layout_2to2", False),
}
_GOALS = {  # name: (ratio, target, higher is better)
    "async_blocking_over_sync_save<=0.15": ("async_blocking_over_sync_save", 0.15, False),
    "sync_save_throughput_over_raw>=0.8": ("sync_save_over_raw_write_throughput", 0.8, True),
    "resharded_load_2to3_over_same_layout<=1.5": ("resharded_load_over_same_layout", 1.5, False),
    "layout_change_load_over_same_layout<=1.5": ("layout_change_load_over_same_layout", 1.5, False),
    "step_overhead_async_every_N<=0.03": ("step_overhead_async_save", 0.03, False),
}


def ratios_of(med: dict[str, float]) -> dict[str, float]:
    """Pure: every ratio whose two medians were measured."""
    return {name: med[a] / med[b] - (1 if minus else 0) for name, (a, b, minus) in _RATIOS.items()
            if a in med and b in med}


def extra_cpu(med: dict[str, float], every: int) -> dict[str, float]:
    """Pure: CPU seconds (both ranks, all their threads, not kernel threads) each
    save adds, from the medians of CPU per step: less sensitive to others' load than time."""
    base = med.get("cpu_step_no_save")
    return {k[len("cpu_step_"):]: round((v - base) * every, 4) for k, v in med.items()
            if base is not None and k.startswith("cpu_step_") and k != "cpu_step_no_save"}


def machine_per_save(samples: dict[str, list[float]], every: int) -> dict[str, dict[str, float]]:
    """Pure: what each save adds to the whole machine's time, by where it went (seconds on
    all CPUs, from the means per step of ``machine_<what>_<kind>``: means, as the kernel
    counts in 10 ms ticks, too coarse for a median of short windows). ``idle`` below zero:
    the save ran in time training left idle; ``steal`` above zero: the hypervisor took that
    much more from this VM's CPUs (host-side I/O work on a VM), which no design inside the
    machine gets back."""
    mean = {k: statistics.fmean(v) for k, v in samples.items() if k.startswith("machine_") and v}
    out: dict[str, dict[str, float]] = {}
    for key, value in mean.items():
        what, kind = key[len("machine_"):].split("_", 1)
        base = mean.get(f"machine_{what}_step_no_save")
        if base is not None and kind.startswith("step_") and kind != "step_no_save":
            out.setdefault(kind[len("step_"):], {})[what] = round((value - base) * every, 4)
    return out


def spread(samples: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Pure: each training kind's overhead, window i paired with no-save window i (same
    round, seconds apart): quartiles, and the mean with its standard error (``se``): how
    finely this run resolves a difference."""
    base = samples.get("step_no_save", [])
    out = {}
    for kind, values in samples.items():
        if kind.startswith("step_") and kind != "step_no_save" and len(values) == len(base) >= 2:
            over = sorted(v / b - 1 for v, b in zip(values, base, strict=True))
            q = statistics.quantiles(over, n=4, method="inclusive")
            out[kind] = {"p25": round(q[0], 4), "median": round(q[1], 4), "p75": round(q[2], 4),
                         "min": round(over[0], 4), "max": round(over[-1], 4),
                         "mean": round(statistics.fmean(over), 4),
                         "se": round(statistics.stdev(over) / len(over) ** 0.5, 4)}
    return out


def summarize(raw: dict, size: int, args: argparse.Namespace) -> dict:
    med = {k: statistics.median(v) for k, v in raw["samples"].items()}
    state = raw["state_bytes"]
    mb = state / (1 << 20)
    ratios = ratios_of(med)
    enough = args.repeats >= MIN_REPEATS_FOR_GOALS and args.windows >= MIN_REPEATS_FOR_GOALS
    goals = {name: _goal(ratios[r], target, higher, enough) for name, (r, target, higher) in _GOALS.items()
             if r in ratios}
    moved = ("raw_write", "dcp_sync_save", "dcp_only_sync_save", "baseline_save")
    return {
        "bench": "checkpoint",
        "config": {"size": args.size, "state_bytes": state, "repeats": args.repeats, "every": args.every,
                   "steps_per_window": args.steps, "windows": args.windows, "train_only": args.train_only,
                   "save_ranks": 2, "load_ranks": [2, 3],
                   "cpus": os.cpu_count(), "threads_per_rank": threads_per_rank(os.cpu_count() or 1),
                   "wall_s": round(raw["wall_s"], 1)},
        "median_s": {k: round(v, 5) for k, v in sorted(med.items())},
        "throughput_MBps": {k: round(mb / med[k], 1) for k in moved if k in med},
        "ratios": {k: round(v, 4) for k, v in ratios.items()},
        "overhead_spread": spread(raw["samples"]),
        "extra_cpu_s_per_save": extra_cpu(med, args.every),
        "machine_s_per_save": machine_per_save(raw["samples"], args.every),
        "goals": goals,
        "all_goals_met": all(g["met"] for g in goals.values()),
        "load": _load(raw),
        "note": "" if enough else f"goals need --repeats and --windows >= {MIN_REPEATS_FOR_GOALS}; marked not met",
        "samples_s": {k: [round(x, 5) for x in v] for k, v in sorted(raw["samples"].items())},
    }


def _load(raw: dict) -> dict:
    """The machine's load average before and after the run (others' work distorts ratios)."""
    return {"before": raw.get("load_before"), "after": raw.get("load_after")}
