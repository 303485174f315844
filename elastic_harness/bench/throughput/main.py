"""``elastic-harness bench throughput``: training samples/s, the harness vs a plain torchrun
DDP script, side by side in one run, one row per comparison (``ROWS``):

- ``cheap``: pre-decoded items, checkpoints off on both sides (the harness's own cost);
- ``costly``: JPEG decode + augmentation per item, the harness with loader processes;
- ``defaults``: what a user meets: the harness with its defaults (the in-memory tier, a
  durable async DCP save every ``--save-every`` steps) against a plain script that
  ``torch.save``s model and optimizer on rank 0 at the same interval;
- ``restart`` (opt-in, ``--only restart``): the ``cheap`` row with ``recovery: restart`` (no
  live groups, no gradient kept for the step in flight): ``cheap`` minus this row is what
  in-place recovery costs per step.
- ``durable`` (opt-in, ``--only durable``): the ``defaults`` row with the in-memory tier off
  (``checkpoint.memory_every: 0``): the durable saves' own cost; the two rows' difference is
  the tier's.

Both sides train the same MLP with AdamW on the same images (``throughput.common``,
``throughput.data``), the same global batch split into the same micro-batches, for the same
number of steps; in the ``cheap`` and ``costly`` rows with no checkpoints
(``checkpoint.every_steps: 0, save_final: false``; the plain script saves nothing):

- plain: ``throughput.plain`` under ``python -m torch.distributed.run --standalone``:
  ``DistributedSampler`` + ``DataLoader(num_workers=0)``, ``no_sync`` accumulation,
  ``loss.backward()``, ``optimizer.step()``.
- harness: ``throughput.harness`` (the same loop on the public API) under ``elastic-harness run``
  with a script job, not under plain torchrun: our agent, step watchdog, events and
  TensorBoard scalars every ``train.log_every`` steps are part of what users pay for, so
  they are part of what is measured. Its loader processes: 0 with cheap items, ``--workers``
  with costly ones (``data.workers``).

Throughput is steady state: rank 0 stamps the top of every step; the first ``--warmup``
steps (process start, allocator and DataLoader warm-up) are skipped and samples/s is
``global_batch * steps / seconds`` over the rest. Runs alternate (repeat r: harness first
when r is even, plain first when odd; cheap then costly) so load drift hits both sides; the
ratio is median harness samples/s over median plain samples/s. Each repeat's two runs
follow each other, so ``paired`` (harness / plain of the same repeat) is what a noisy
machine distorts least: its median and spread (quartiles, extremes) are in the JSON, and
so is the same paired ratio in CPU time per step of rank 0's process
(``cpu_paired``: plain CPU per step / harness CPU per step), which other processes'
load moves far less than wall time. Goals are judged on the paired median. Rank 0's loop
is timed by phase (``phases_ms``:
compute, optimizer, hook, outside the loop body). Goals:

- cheap items (pre-decoded tensors): harness / plain                               >= 0.97
- costly items (JPEG decode + augmentation per item, ``--image-px``): harness with
  ``--workers`` loader processes / plain loading in its training process          >= 1.5
- defaults (saves on both sides, cheap items): harness / plain                     >= 0.97
- hsdp (opt-in, ``--only hsdp``; cheap items, no saves): FSDP2 on a 2-D mesh, 2 replicas
  x ``--nproc-layout``/2 shards, the harness's mesh layout ``{shard: nproc/2}`` on one node
  (``run.mesh``) vs the same ``init_device_mesh`` + ``fully_shard`` under torchrun  >= 0.97

To add a row (another data source, another setting), add a ``Row`` to ``ROWS`` and, if
its sides need more, a branch in ``sides.harness_job`` / ``sides.plain_command``.

A run that fails (exits non-zero, or leaves too few step stamps) does not end the bench: its
repeat's pair is left out of every figure of its row and listed in ``failed_pairs`` with the
failing side's error (``failed_runs`` counts them); goals need ``MIN_REPEATS_FOR_GOALS`` good
pairs per row. The exit code is 1 only when a row has no good pair at all.

Each run also records the CPU seconds its processes used and, from ``/proc/stat``, how
many cores other processes kept busy meanwhile (``others_cores_median``): on a shared
machine that is the load the ratios were measured under. Parallel loading can only help
where a core is free for it.

Choices for a 2-core machine, stated in the JSON: every rank computes on ``--threads`` (1)
torch thread. Cheap items use 2 ranks per node (both cores compute). Costly items use 1
rank (``--nproc-costly``): with 2 ranks both cores would already compute, leaving loader
processes no core, whereas on a real GPU node the accelerator computes and the host's spare
cores load. The MLP (``--hidden`` 1024, 3072 -> 1024 -> 1024 -> 10, 4.2 M parameters) takes
a few tens of ms per 32-sample micro-batch on one thread: per-step overheads show, but do
not dominate. ``--image-px`` 96 makes an item cost about a millisecond, so loading a step's
64 items costs about what computing them does (where parallel loading matters most).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from elastic_harness.bench import check_out, scratch_dir
from elastic_harness.bench.throughput.stats import cpu_per_step_ms, ratio, spread, steady_rate
from elastic_harness.deps import require_extra
from elastic_harness.errors import HarnessError


@dataclass(frozen=True)
class Row:
    """One comparison of the bench: which data both sides read, how many ranks, the goal."""

    name: str
    data: str  # data.KINDS: what both scripts load
    goal: float | None  # harness / plain samples/s, at least (None: a diagnostic row)
    costly: bool = False  # --nproc-costly ranks and the harness with --workers loader processes
    saves: bool = False  # harness defaults (memory tier, saves) vs plain torch.save on rank 0
    tier: bool = True  # with saves: the in-memory tier on (the default) or off
    hsdp: bool = False  # --nproc-layout ranks as replicate x shard (2 x nproc/2), FSDP2 on both sides
    opt_in: bool = False  # run only when named in --only
    recovery: str = "in_place"  # the harness job's ``recovery``


ROWS = {
    "cheap": Row("cheap", "cheap", 0.97),
    "costly": Row("costly", "costly", 1.5, costly=True),
    "defaults": Row("defaults", "cheap", 0.97, saves=True),
    # The defaults less the in-memory tier: what the durable saves alone cost (defaults minus
    # this row is the tier's share, which its budget, 3% of step time, bounds). Opt-in.
    "durable": Row("durable", "cheap", None, saves=True, tier=False, opt_in=True),
    "hsdp": Row("hsdp", "cheap", 0.97, hsdp=True, opt_in=True),
    # The cheap row with every fault a restart: what in-place recovery's per-step path (live
    # groups, the step in flight's gradient keep) costs, against the cheap row. Opt-in.
    "restart": Row("restart", "cheap", None, recovery="restart", opt_in=True),
}
CASES = tuple(ROWS)
SIDES = ("harness", "plain")
GOALS = {name: row.goal for name, row in ROWS.items()}
MIN_REPEATS_FOR_GOALS = 5
LOG_EVERY = 10  # both sides: the loss (and for the harness its step event) every 10 steps


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("throughput", help="samples/s, harness vs a plain torchrun DDP script (JSON)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="runs per side and case; medians (default 5)")
    p.add_argument("--steps", type=int, default=120, help="optimizer steps per run (default 120)")
    p.add_argument("--warmup", type=int, default=20, help="first steps not timed (default 20)")
    p.add_argument("--global-batch", type=int, default=64, help="samples per step (default 64)")
    p.add_argument("--micro-batch", type=int, default=32, help="samples per forward (default 32)")
    p.add_argument("--hidden", type=int, default=1024, help="MLP width (default 1024)")
    p.add_argument("--items", type=int, default=2048, help="images in the data set (default 2048)")
    p.add_argument("--image-px", type=int, default=96, help="stored JPEG side, costly items (default 96)")
    p.add_argument("--workers", type=int, default=2, help="harness loader processes per rank, costly (default 2)")
    p.add_argument("--nproc-cheap", type=int, default=2, help="ranks with cheap items (default 2)")
    p.add_argument("--nproc-costly", type=int, default=1, help="ranks with costly items (default 1)")
    p.add_argument("--nproc-layout", type=int, default=4,
                   help="hsdp row (opt-in: --only hsdp): ranks, as 2 replicas x nproc/2 shards (default 4)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--save-every", type=int, default=50,
                   help="defaults row: a save every N steps on both sides (default 50)")
    p.add_argument("--only", action="append", choices=CASES, help="run only this case (repeatable)")
    p.add_argument("--dir", help="scratch directory (default: system temp; removed after)")
    p.add_argument("--keep", action="store_true", help="keep the run dirs and logs")
    p.add_argument("--out", help="also write the JSON here")
    from elastic_harness.bench.throughput import stream  # its rows and flags (--stream ...)

    stream.add_arguments(p)
    p.set_defaults(func=cmd_throughput)


def check_args(args: argparse.Namespace) -> None:
    """Refuse a configuration that cannot run or measure anything, before anything starts."""
    positive = {"--repeats": args.repeats, "--steps": args.steps, "--global-batch": args.global_batch,
                "--micro-batch": args.micro_batch, "--hidden": args.hidden, "--threads": args.threads,
                "--nproc-cheap": args.nproc_cheap, "--nproc-costly": args.nproc_costly,
                "--nproc-layout": args.nproc_layout}
    for flag, value in positive.items():
        if value < 1:
            raise HarnessError(f"{flag} must be >= 1, got {value}")
    if args.warmup < 0 or args.workers < 0:
        raise HarnessError("--warmup and --workers must be >= 0")
    if args.steps < args.warmup + 3:
        raise HarnessError(f"--steps {args.steps} leaves fewer than 2 timed steps after --warmup {args.warmup}",
                           "use --steps >= --warmup + 3")
    saves = any(ROWS[c].saves for c in cases_of(args))
    if saves and (args.save_every < 1 or (args.steps - args.warmup) % args.save_every):
        raise HarnessError(f"the defaults row times steps {args.warmup + 1}..{args.steps}, not a whole "
                           f"number of --save-every {args.save_every} intervals",
                           "make --steps minus --warmup a multiple of --save-every")
    for case in cases_of(args):
        n = nproc_of(args, case)
        if args.global_batch % (n * args.micro_batch):
            raise HarnessError(f"--global-batch {args.global_batch} is not a multiple of {n} ranks x "
                               f"--micro-batch {args.micro_batch} ({case} items)",
                               "pick sizes that divide evenly (the plain script accumulates whole micro-batches)")
        if ROWS[case].hsdp and (n < 2 or n % 2):
            raise HarnessError(f"--nproc-layout {n}: the hsdp row needs an even number of ranks (2 replicas)")
        if args.items < args.global_batch:
            raise HarnessError(f"--items {args.items} is smaller than --global-batch {args.global_batch}")
    if not 32 <= args.image_px <= 1024:
        raise HarnessError(f"--image-px must be 32..1024, got {args.image_px}")


def cases_of(args: argparse.Namespace) -> list[str]:
    return [c for c in CASES if (c in args.only if args.only else not ROWS[c].opt_in)]


def nproc_of(args: argparse.Namespace, case: str) -> int:
    if ROWS[case].hsdp:
        return args.nproc_layout
    return args.nproc_costly if ROWS[case].costly else args.nproc_cheap


def cmd_throughput(args: argparse.Namespace) -> int:
    check_args(args)
    require_extra("bench")  # every row's images are JPEGs (Pillow), the streaming rows' costly items too
    check_out(args.out)
    scratch = scratch_dir("eh-throughput-", args.dir)
    load_before = os.getloadavg()
    # SIGTERM unwinds like Ctrl-C, so the side running now is stopped (its processes live
    # in their own session and would not get the signal) and the scratch dir removed.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    stream = getattr(args, "stream", "off")
    try:
        results = measure(args, scratch) if stream in ("off", "also") else []
        streamed = _stream_rows(args, scratch) if stream != "off" else None
    finally:
        signal.signal(signal.SIGTERM, previous)
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    report = summarize(results, args, load=(load_before, os.getloadavg()),
                       kept=str(scratch) if args.keep else None) if stream in ("off", "also") else {"bench": "throughput"}
    if streamed is not None:
        report["stream"] = streamed
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if stream not in ("off", "also"):
        return 0
    code = exit_code(report, cases_of(args))
    for c in cases_of(args):
        for f in report[c]["failed_pairs"]:
            print(f"bench throughput: {c} repeat {f['repeat']} left out: " +
                  "; ".join(f"{s} {f[s]}" for s in SIDES if s in f), file=sys.stderr)
    return code


def _stream_rows(args: argparse.Namespace, scratch: Path) -> dict:
    from elastic_harness.bench.throughput import stream

    return stream.measure(args, scratch, steady_rate)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def schedule(repeats: int, cases: list[str]) -> list[tuple[int, str, str]]:
    """Pure: (repeat, case, side) in run order; the side that goes first alternates."""
    order = []
    for r in range(repeats):
        sides = SIDES if r % 2 == 0 else SIDES[::-1]
        order += [(r, case, side) for case in cases for side in sides]
    return order


def measure(args: argparse.Namespace, scratch: Path) -> list[dict]:
    from elastic_harness.bench.throughput import sides
    from elastic_harness.bench.throughput.data import write_images

    data_dir = scratch / "data"
    data_dir.mkdir()
    write_images(data_dir, args.items, args.image_px)
    results = []
    for r, case, side in schedule(args.repeats, cases_of(args)):
        run_dir = scratch / f"{case}-{side}-{r}"
        try:
            record = sides.launch(side, ROWS[case], args, data_dir, run_dir, nproc_of(args, case), LOG_EVERY)
            record.update(repeat=r, case=case, side=side,
                          samples_per_s=steady_rate(record["stamps"], args.warmup, args.global_batch),
                          cpu_ms_per_step=cpu_per_step_ms(record["cpu"], args.warmup),
                          phases_ms={k: _median_ms(v[args.warmup:]) for k, v in record["phases"].items()},
                          hook_ms=_median_ms(record["hook_s"][args.warmup:]))
        except (HarnessError, ValueError) as e:  # one run failed: its pair is reported, the rest kept
            why = e.message if isinstance(e, HarnessError) else f"its step stamps cannot be timed: {e}"
            results.append({"repeat": r, "case": case, "side": side, "failed": why})
            print(f"bench throughput: {case} {side} repeat {r} FAILED: {why}", file=sys.stderr, flush=True)
            continue
        for key in ("stamps", "cpu", "hook_s", "phases"):
            del record[key]
        results.append(record)
        print(f"bench throughput: {case} {side} repeat {r}: {record['samples_per_s']:.1f} samples/s",
              file=sys.stderr, flush=True)
    return results


# --- pure pieces: rates, medians, goals --------------------------------------------------------


def _median_ms(xs: list[float]) -> float | None:
    return round(statistics.median(xs) * 1e3, 3) if xs else None


def goal(value: float | None, target: float, enough: bool) -> dict:
    met = value is not None and value >= target
    return {"value": value, "target": f">= {target}", "met": bool(met and enough)}


def failed_pairs(results: list[dict], case: str) -> list[dict]:
    """Pure: the repeats of ``case`` with a failed side: which side, and what it said."""
    failed: dict[int, dict] = {}
    for x in results:
        if x["case"] == case and x.get("failed"):
            failed.setdefault(x["repeat"], {"repeat": x["repeat"]})[x["side"]] = x["failed"]
    return [failed[r] for r in sorted(failed)]


def summarize_case(results: list[dict], case: str) -> dict:
    """Medians per side, their ratio, and the ratio of each repeat's adjacent pair, over the
    good pairs only (a repeat whose harness or plain run failed is left out of all of them
    and listed in ``failed_pairs``, with the failing side's error)."""
    failed = failed_pairs(results, case)
    bad = {f["repeat"] for f in failed}
    runs = {s: sorted((x for x in results if x["case"] == case and x["side"] == s and x["repeat"] not in bad),
                      key=lambda x: x["repeat"])
            for s in SIDES}
    rates = {s: [x["samples_per_s"] for x in runs[s]] for s in SIDES}
    med = {s: statistics.median(v) if v else None for s, v in rates.items()}
    pairs = [ratio(h, p) for h, p in zip(rates["harness"], rates["plain"], strict=False)]
    cpu = {s: [x.get("cpu_ms_per_step") for x in runs[s]] for s in SIDES}
    cpu_pairs = [ratio(p, h) for h, p in zip(cpu["harness"], cpu["plain"], strict=False)]
    phases = {s: {k: _round(statistics.median(v)) for k, v in _by_phase(runs[s]).items()} for s in SIDES}
    return {
        "harness_samples_per_s": _round(med["harness"]), "plain_samples_per_s": _round(med["plain"]),
        "ratio": ratio(med["harness"], med["plain"]),
        "paired_ratios": pairs,
        "paired": spread(pairs),
        "cpu_ms_per_step_median": {s: _round(statistics.median([c for c in cpu[s] if c is not None] or [0.0]))
                                   for s in SIDES},
        "cpu_paired": spread(cpu_pairs),
        "phases_ms": phases,
        "harness_hook_ms_median": _round(statistics.median([x["hook_ms"] for x in runs["harness"]
                                                            if x["hook_ms"] is not None] or [0.0])),
        "samples_trained": {s: [x["samples"] for x in runs[s]] for s in SIDES},
        "world_size": {s: sorted({x["world_size"] for x in runs[s]}) for s in SIDES},
        "wall_s_median": {s: _median_of(runs[s], "wall_s") for s in SIDES},
        "others_cores_median": {s: _median_of(runs[s], "others_cores") for s in SIDES},
        "samples_per_s": {s: [_round(v) for v in rates[s]] for s in SIDES},
        "good_pairs": len(pairs),
        "failed_pairs": failed,
    }


def _by_phase(runs: list[dict]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for run in runs:
        for phase, ms in (run.get("phases_ms") or {}).items():
            if ms is not None:
                out.setdefault(phase, []).append(ms)
    return out


def _median_of(runs: list[dict], key: str) -> float | None:
    xs = [x[key] for x in runs if x.get(key) is not None]
    return _round(statistics.median(xs)) if xs else None


def _round(x: float | None, digits: int = 2) -> float | None:
    return None if x is None else round(x, digits)


def summarize(results: list[dict], args: argparse.Namespace, load: tuple, kept: str | None) -> dict:
    cases = cases_of(args)
    per_case = {c: summarize_case(results, c) for c in cases}
    enough = args.repeats >= MIN_REPEATS_FOR_GOALS and all(per_case[c]["good_pairs"] >= MIN_REPEATS_FOR_GOALS
                                                           for c in cases)
    for c in cases:
        per_case[c].update(nproc_per_node=nproc_of(args, c), expected_samples=args.steps * args.global_batch,
                           harness_data_workers=args.workers if ROWS[c].costly else 0, plain_num_workers=0,
                           saves_every=args.save_every if ROWS[c].saves else 0)
    goals = {f"{c}_harness_over_plain>={GOALS[c]}": goal(per_case[c]["paired"]["median"], GOALS[c], enough)
             for c in cases if GOALS[c] is not None}
    return {
        "bench": "throughput",
        "config": config_of(args, load, kept),
        **per_case,
        "goals": goals,
        "all_goals_met": all(g["met"] for g in goals.values()),
        "note": "" if enough else f"goals need {MIN_REPEATS_FOR_GOALS} good pairs per row (--repeats >= "
                f"{MIN_REPEATS_FOR_GOALS}, no failed run); marked not met",
        "failed_runs": sum(len(per_case[c]["failed_pairs"]) for c in cases),
    }


def exit_code(report: dict, cases: list[str]) -> int:
    """Pure: 1 when a row has no good pair (nothing of it was measured), else 0: failed pairs
    are reported in the JSON (``failed_pairs``) and leave the other pairs' figures standing."""
    return 1 if any(report[c]["good_pairs"] == 0 for c in cases) else 0


def config_of(args: argparse.Namespace, load: tuple, kept: str | None) -> dict:
    return {
        "steps": args.steps, "warmup_steps": args.warmup, "repeats": args.repeats,
        "global_batch": args.global_batch, "micro_batch": args.micro_batch,
        "model": f"MLP 3072-{args.hidden}-{args.hidden}-10, AdamW", "items": args.items,
        "image_px": args.image_px, "threads_per_rank": args.threads, "cpus": os.cpu_count(),
        "nproc_per_node": {c: nproc_of(args, c) for c in cases_of(args)},
        "why_nproc_costly": "costly items: one rank computes on one core, leaving the other to loader "
                            "processes (on a GPU node the accelerator computes and spare cores load)",
        "harness": "elastic-harness run, script job (tput_harness): our agent, watchdog, events/TensorBoard "
                   f"every {LOG_EVERY} steps",
        "plain": "python -m torch.distributed.run --standalone (tput_plain): DistributedSampler + "
                 f"DataLoader(num_workers=0), loss printed every {LOG_EVERY} steps",
        "checkpoints": "cheap, costly: none on either side; defaults: the harness's defaults (in-memory "
                       f"tier, async DCP save every {args.save_every} steps) vs torch.save of model and "
                       f"optimizer on rank 0 every {args.save_every} steps",
        "load_avg_1_5_15": {"before": [round(x, 2) for x in load[0]], "after": [round(x, 2) for x in load[1]]},
        "run_dirs": kept,
    }
