"""``elastic-harness report RUN_DIR`` and ``elastic-harness verify RUN_DIR REF_RUN_DIR``.

``report`` reads ``RUN_DIR/events.jsonl`` and prints, per injected fault and per failure
nobody injected (a worker killed from outside, a frozen node, an exception), when it was
detected, when the rendezvous completed, when the checkpoint was loaded and when the first
step after it finished, and the steps lost, then the goodput and its badput
(``report.timeline`` defines each term). It draws ``RUN_DIR/report.png``. ``verify`` compares the final models of two runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from elastic_harness import exitcodes, runfiles
from elastic_harness.chaos.vocabulary import KINDS
from elastic_harness.deps import MissingExtra, require_extra
from elastic_harness.errors import CheckpointError, HarnessError, RunDirError
from elastic_harness.events import read_events
from elastic_harness.report.inplace import FINISH, IN_PLACE, Kept, Recovered
from elastic_harness.report.timeline import BADPUT_KINDS, FaultRow, Timeline, build

# What the tests accept after a resize (reduction order changes): see tests/e2e/test_e2e_core.py.
DEFAULT_ATOL, DEFAULT_RTOL = 1e-5, 1e-4


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="per-fault recovery times, goodput, report.png",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="run directory (holds events.jsonl)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--no-plot", action="store_true", help="do not write report.png")
    p.set_defaults(func=cmd_report)
    v = sub.add_parser("verify", help="compare the final models of two runs (exit 1 if they differ)")
    v.add_argument("run_dir", help="run directory to check")
    v.add_argument("ref_run_dir", help="reference run directory")
    v.add_argument("--atol", type=float, default=DEFAULT_ATOL, help=f"absolute tolerance (default {DEFAULT_ATOL})")
    v.add_argument("--rtol", type=float, default=DEFAULT_RTOL, help=f"relative tolerance (default {DEFAULT_RTOL})")
    v.add_argument("--json", action="store_true", help="print JSON")
    v.set_defaults(func=cmd_verify)


def load_timeline(run_dir: Path) -> Timeline:
    path = run_dir / runfiles.EVENTS
    if not path.is_file():
        raise RunDirError(f"no events.jsonl in '{run_dir}'", "name a run directory that 'elastic-harness run' wrote")
    events = read_events(path)
    if not events:
        raise RunDirError(f"'{path}' has no events", "run the job first")
    return build(events)


def cmd_report(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    tl = load_timeline(run_dir)
    plot_path = None
    if not args.no_plot and not can_plot():
        args.no_plot = True  # the text is the report; the plot is the extra's
    if not args.no_plot:
        from elastic_harness.report.plot import draw

        plot_path = draw(tl, run_dir / runfiles.REPORT_PLOT, title=f"{run_dir.name}: " + _headline(tl))
    if args.json:
        print(json.dumps(as_json(tl, run_dir, plot_path), indent=1))
    else:
        print("\n".join(render(tl, run_dir)))
        if plot_path:
            print(f"plot: {plot_path}")
    return 0


def can_plot() -> bool:
    """Whether ``report.png`` can be drawn (the ``report`` extra); when not, says so once on
    stderr with how to get it: the text report does not need it."""
    try:
        require_extra("report")
    except MissingExtra as e:
        print(f"note: no {runfiles.REPORT_PLOT}: {e.message} (or pass --no-plot to skip it)", file=sys.stderr)
        return False
    return True


def as_json(tl: Timeline, run_dir: Path, plot_path: Path | None) -> dict:
    return {
        "run_dir": str(run_dir), "invocations": tl.invocations, "generations": tl.generations,
        "faults": [fault_json(f) for f in tl.faults], "failures": failure_count(tl.faults),
        "goodput": dataclasses.asdict(tl.goodput), "plot": str(plot_path) if plot_path else None,
        "memory_probe": dataclasses.asdict(tl.probe) if tl.probe else None,
        "excluded": tl.excluded,
    }


def fault_json(f: FaultRow) -> dict:
    """One row of ``report --json``: its fields, and under ``recovered_how`` also how many
    survivors kept their process and whether the in-place path fell back (``report.inplace``)."""
    out = dataclasses.asdict(f)
    how = f.recovered_how
    if how is not None:
        out["recovered_how"].update(survivors_kept=how.survivors_kept, fell_back=how.fell_back)
    return out


def failure_count(rows: list[FaultRow]) -> str:
    """``3 failures: 1 injected, 2 not; 2 recovered (1 in place), 9 steps lost``, then the other faults
    injected (a node added, a link healed: ``chaos.vocabulary.Kind.failure``), which are
    rows of the table but no failures (each ``add-node`` was counted as one)."""
    failures = [r for r in rows if is_failure(r)]
    injected = sum(r.injected for r in failures)
    recovered = sum(r.first_step is not None for r in failures)
    in_place = sum(r.recovered_how is not None and r.recovered_how.way == IN_PLACE for r in failures)
    lost = sum(r.steps_lost or 0 for r in failures)
    others = sorted({r.kind for r in rows if not is_failure(r)})
    more = f"; and {len(rows) - len(failures)} other fault(s) injected ({', '.join(others)})" if others else ""
    return (f"{len(failures)} failure(s): {injected} injected, {len(failures) - injected} not; "
            f"{recovered} recovered ({in_place} in place), {lost} step(s) lost{more}")


def is_failure(row: FaultRow) -> bool:
    """Pure: is the row a failure (every one nobody injected, and an injected fault whose
    kind is one: not ``add-node`` or ``heal``)?"""
    kind = KINDS.get(row.kind)
    return not row.injected or kind is None or kind.failure


def _headline(tl: Timeline) -> str:
    g = tl.goodput
    return f"goodput {g.goodput:.1%} ({g.productive_s:.1f} s productive of {g.wall_s:.1f} s wall)"


def _at(x: float | None, base: float) -> str:
    return "-" if x is None else f"+{x - base:.2f}"


def _fault_line(f: FaultRow) -> str:
    lost = "-" if f.steps_lost is None else str(f.steps_lost) + (" (drained)" if f.graceful else "")
    if f.source:
        lost += f"  from {f.source}"
    cells = [str(f.index), f.kind, "-" if f.target is None else str(f.target), "-" if f.step is None else str(f.step),
             f"{f.t:.2f}",
             _at(f.detected, f.t), _at(f.rendezvous, f.t), _at(f.loaded, f.t), _at(f.first_step, f.t),
             "-" if f.resumed_from is None else str(f.resumed_from), lost]
    return _row(cells)


def how_line(how: Recovered) -> str:
    """Pure: how a fault was recovered, in words: in place (and how) or restarted, which
    survivors kept their process (by rank and pid), who is new, the in-place phases."""
    if how.way == IN_PLACE:
        head = f"in place ({how.mode})"
    else:
        head = "restarted" + (" (the in-place path failed)" if how.tried else "")
    parts = [head]
    if how.survivors is not None:
        parts.append(f"{how.survivors_kept} of {len(how.survivors)} survivor(s) kept their process")
    if how.kept:
        parts.append("kept: " + ", ".join(_kept_words(k) for k in how.kept))
    if how.new:
        parts.append("new: " + ", ".join(f"rank {m.rank} (pid {m.pid})" for m in how.new))
    if how.phases_s:
        words = {**PHASE_WORDS, "restore": "finish the step"} if how.mode == FINISH else PHASE_WORDS
        parts.append(", ".join(f"{words[k]} {'-' if v is None else f'{v:.3f}'}" for k, v in how.phases_s.items())
                     + " s")
    return "; ".join(parts)


PHASE_WORDS = {"leave": "leave", "park": "park", "reform": "re-form", "restore": "restore", "first_step": "first step"}


def _kept_words(k: Kept) -> str:
    moved = "" if k.after.rank == k.before.rank else f", now rank {k.after.rank}"
    return f"rank {k.before.rank} (pid {k.before.pid}{moved})"


def _row(cells: list[str]) -> str:
    widths = (3, 12, 6, 6, 8, 9, 11, 8, 11, 8, 0)
    return "  ".join(c.rjust(w) if i != 1 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()


def render(tl: Timeline, run_dir: Path) -> list[str]:
    lines = [f"run dir: {run_dir}  ({tl.invocations} invocation(s), {tl.generations} worker generation(s))"]
    if tl.faults:
        lines.append(failure_count(tl.faults) + " (at: seconds since the run started; +s: seconds after it)")
        lines.append(_row(["#", "kind", "target", "step", "at", "detected", "rendezvous", "loaded",
                           "first step", "resumed", "steps lost"]))
        lines += [_fault_line(f) for f in tl.faults]
        lines += [f"  #{f.index} not injected: {f.cause}" for f in tl.faults if not f.injected and f.cause]
        lines += [f"  #{f.index} {how_line(f.recovered_how)}" for f in tl.faults if f.recovered_how is not None]
    else:
        lines.append("no failures, no faults injected")
    for out in tl.excluded:
        lines.append(f"kept out (a bad node): node {out['node']}: {out['message']}")
    g = tl.goodput
    lines.append(_headline(tl))
    for kind in BADPUT_KINDS:
        share = g.badput[kind] / g.wall_s if g.wall_s else 0.0
        lines.append(f"  {kind:<20} {g.badput[kind]:9.2f} s  {share:6.1%}")
    if tl.probe:
        p = tl.probe
        lines.append(f"in-memory tier cost (checkpoint.memory_probe): {p.cost:+.1%} step time, median of "
                     f"{len(p.pairs)} neighbouring on/off block pairs (mean step {p.on_step_s * 1e3:.2f} ms "
                     f"on, {p.off_step_s * 1e3:.2f} ms off, {p.steps} steps)")
    return lines


# --- verify -------------------------------------------------------------------------------


def final_checkpoint(run_dir: Path):
    """(storage, step dir name) of the newest complete checkpoint that verifies."""
    if not run_dir.is_dir():  # before torch is imported (offline): a typo answers at once
        raise RunDirError(f"'{run_dir}' is not a directory", "name a run directory")
    from elastic_harness.checkpoint.offline import newest_usable
    from elastic_harness.checkpoint.storage import open_storage

    root = _checkpoint_root(run_dir)
    storage = open_storage(root)
    key = _run_key(run_dir)
    choice = newest_usable(storage, "full", key=key)  # reads manifests and checksums, no pickle
    if choice.chosen is not None and key is None:
        raise CheckpointError(f"cannot check who wrote the checkpoints of '{run_dir}': it has no job.key "
                              "(a run from before checkpoints were signed)",
                              f"if you trust it, review and sign it: elastic-harness ckpt trust {run_dir} "
                              f"--step {choice.chosen.step} --key {run_dir}/job.key")
    if choice.chosen is not None:
        return storage, choice.chosen.name
    if not choice.complete:
        raise CheckpointError(f"no complete checkpoint in {root} (run dir '{run_dir}')",
                              "finish the run first, or name a run dir that has saved checkpoints")
    raise CheckpointError(f"no checkpoint in {root} verifies: " + "; ".join(f"{s.name}: {s.reason}" for s in choice.failed),
                          "see 'elastic-harness ckpt ls' for the run dir")


def _run_key(run_dir: Path) -> bytes | None:
    """The run's key (its checkpoints are read only if signed with it, docs/security.md),
    or None for a run from before checkpoints were signed."""
    from elastic_harness import jobkey

    path = run_dir / jobkey.KEY_FILE
    return jobkey.read(path) if path.is_file() else None


def _checkpoint_root(run_dir: Path) -> str:
    """Where the run keeps its checkpoints (``checkpoint.where``, via its resolved spec)."""
    from elastic_harness.checkpoint.offline import run_checkpoint_root

    return run_checkpoint_root(run_dir)


def within(a: dict, b: dict, atol: float, rtol: float) -> bool:
    """Every element satisfies |a - b| <= atol + rtol * |b| (b is the reference)."""
    return all(
        bool(((a[k].double() - b[k].double()).abs() <= atol + rtol * b[k].double().abs()).all()) for k in a
    )


def cmd_verify(args: argparse.Namespace) -> int:
    ok, result = compare_runs(Path(args.run_dir), Path(args.ref_run_dir), args.atol, args.rtol)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"{result['run']}\n  vs {result['reference']}\n{result['verdict']}")
    return 0 if ok else 1


def compare_runs(run_dir: Path, ref_run_dir: Path, atol: float = DEFAULT_ATOL,
                 rtol: float = DEFAULT_RTOL) -> tuple[bool, dict]:
    """(the final models agree, what ``verify --json`` prints). ``HarnessError`` (exit 2) when
    either run has no final checkpoint to read (``final_checkpoint``)."""
    found = [final_checkpoint(where) for where in (run_dir, ref_run_dir)]
    # torch is imported once the paths are found: a typo answers at once
    from elastic_harness.checkpoint.offline import compare, load_model_tensors

    (a, where_a), (b, where_b) = [(load_model_tensors(s.reader(n)), s.uri(n)) for s, n in found]
    diff = compare(a, b)
    ok = diff["comparable"] and (diff["identical"] or within(a, b, atol, rtol))
    return ok, {"run": where_a, "reference": where_b, "ok": ok, "verdict": _verdict(diff, ok, atol, rtol), **diff}


def _verdict(diff: dict, ok: bool, atol: float, rtol: float) -> str:
    if not diff["comparable"]:
        return f"NOT COMPARABLE (different parameters or shapes): {json.dumps({k: v for k, v in diff.items() if k != 'comparable'})}"
    if diff["identical"]:
        return "bit-identical"
    where = "within" if ok else "OUTSIDE"
    return f"differs: max abs {diff['max_abs']:.3g}, max rel {diff['max_rel']:.3g} ({where} atol={atol:g}, rtol={rtol:g})"


def check_reference(reference: Path) -> None:
    """``--verify REF``: the reference run has a final checkpoint that verifies, or one line
    now (exit 2), before any agent starts."""
    try:
        final_checkpoint(reference)
    except HarnessError as e:
        raise HarnessError(f"--verify {reference}: {e.message}", e.hint or "name a finished run's directory") \
            from None


def compare_with(run_dir: Path, reference: str) -> HarnessError | None:
    """``--verify``: the final model against the reference run's, printed as ``verify`` prints
    it; the error the run ends with (exit 1: they differ; 2: a checkpoint cannot be read),
    else None."""
    try:
        ok, result = compare_runs(run_dir, Path(reference))
    except HarnessError as e:
        return HarnessError(f"--verify {reference}: {e.message}", e.hint)
    print(f"{result['run']}\n  vs {result['reference']}\n{result['verdict']}")
    if ok:
        return None
    error = HarnessError(f"--verify: the final model is not {reference}'s: {result['verdict']}",
                         "the two runs trained different models: compare their jobs (docs/tolerance.md)")
    error.exit_code = exitcodes.FAILED
    return error
