"""The harness's side of ``bench inflight``: one ``elastic-harness run`` of the job with the
node loss (started as the recovery benches start theirs: ``recovery.launching.run_harness``),
and its figures from the run's events and sample records (``train.record_samples``).

Healthy ranks: every rank but those of the lost node (the ``worker`` events of the
generation the fault hit name each rank's node). A step's counting records are those of the
latest generation that recorded it (as the audit reads them).

- discarded micro-batches: those of a healthy rank's record of a redone step in a
  generation that did not count (the record is written as the step starts);
- steps redone: steps recorded by a healthy rank in a generation that did not count, except
  the ones a ``finished`` event says were finished in place (their records carry on);
- longest gap: between two consecutive ``step`` events (one per committed step, written by
  rank 0) of healthy processes, during the loss (``gaps``), beside the whole run's and the
  median of those intervals;
- global batch held: every step's counting records hold exactly its global batch's positions.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from elastic_harness import runfiles
from elastic_harness.bench.inflight import gaps as gaps_during
from elastic_harness.bench.inflight import job
from elastic_harness.bench.recovery.launching import run_harness
from elastic_harness.data.sampler import micro_batches
from elastic_harness.events import read_events
from elastic_harness.runtime.audit import read_sample_records

RECORD_SAMPLES = "train.record_samples=true"


def fault_spec(kill_at: int, in_step: bool) -> str:
    """The chaos fault: node 1 right after step ``kill_at``, or in the next step's reduction."""
    return f"kill-node:1@{kill_at}" + ("+reduction" if in_step else "")


def run(run_dir: Path, *, groups: int, steps: int, kill_at: int, in_step: bool, timeout_s: float) -> dict:
    """One run on ``groups`` nodes of one rank; its row and details."""
    spec = job.write(run_dir.parent / f"{run_dir.name}.yaml", steps, groups)
    code = run_harness(spec, run_dir, groups, 1, [fault_spec(kill_at, in_step)], int(timeout_s), [RECORD_SAMPLES])
    out = analyze(read_events(run_dir / runfiles.EVENTS), read_sample_records(run_dir), steps=steps,
                  global_batch=job.GLOBAL_BATCH, micro_batch=job.MICRO_BATCH)
    verdict = "completed" if code == 0 and out["completed"] else f"exit {code}" if code else "incomplete"
    done = verdict == "completed"
    keys = ("discarded_micro_batches", "longest_gap_s", "longest_gap_anywhere_s", "median_step_s", "steps_redone")
    row = {"verdict": verdict, **{k: out[k] if done else None for k in keys},
           "global_batch_held": done and out["global_batch_held"]}
    return {"row": row, "verdict": verdict, "exit": code, **out}


def lost_ranks(events: list[dict]) -> tuple[str | None, set[int], set[int]]:
    """The generation the first fault hit, the ranks it lost there and their pids."""
    fault = next((e for e in events if e["event"] == "fault"), None)
    if fault is None:
        return None, set(), set()
    before = [e for e in events if e["event"] == "rendezvous" and e["t"] <= fault["t"]]
    if not before:
        return None, set(), set()
    restart = before[-1].get("restart")
    hit = [e for e in events if e["event"] == "worker" and e.get("restart") == restart
           and str(e.get("node")) == str(fault.get("target"))]
    return before[-1].get("generation"), {e["rank"] for e in hit}, {e["pid"] for e in hit}


def counting(records: list[dict]) -> dict[int, str]:
    """Step -> the generation whose records count: the latest that recorded it."""
    latest: dict[int, tuple[int, str]] = {}
    for r in records:
        if r["step"] not in latest or r["t_ns"] > latest[r["step"]][0]:
            latest[r["step"]] = (r["t_ns"], r["generation"])
    return {step: gen for step, (_, gen) in latest.items()}


def analyze(events: list[dict], records: list[dict], *, steps: int, global_batch: int, micro_batch: int) -> dict:
    """The module doc's figures (pure)."""
    fault_gen, lost, lost_pids = lost_ranks(events)
    counts = counting(records)
    healthy = [r for r in records if not (r["generation"] == fault_gen and r["rank"] in lost)]
    stale = [r for r in healthy if r["generation"] != counts[r["step"]]]
    finished = {e["step"] for e in events if e["event"] == "finished"}
    redone = sorted({r["step"] for r in stale} - finished)
    discarded = sum(min(micro_batches(global_batch, r["dp_size"], micro_batch), len(r["positions"]))
                    for r in stale if r["step"] in redone)
    return {"discarded_micro_batches": discarded, "steps_redone": len(redone), "redone_steps": redone,
            "finished_in_place": sorted(finished), **gap_figures(events, lost_pids),
            **batch_figures(records, counts, steps, global_batch),
            "fault": fault_figures(events, lost_pids),
            "recovery_modes": [e.get("mode") for e in events if e["event"] == "recovery"],
            "fell_back": [e.get("message") for e in events if e["event"] == "warning"][:3]}


def fault_figures(events: list[dict], lost_pids: set[int]) -> dict:
    """Seconds from the fault to each moment of the first survivor's recovery, in order: its
    generation broke under it (``to_detected_s``), it had its place in the next generation
    from its agent (``to_placed_s``), it re-formed (with its phases), the step in flight
    finished in place (with the ``finished`` event's phases) and the next step event of a
    healthy process. The first two are its ``reformed`` event less its phases, which are
    consecutive from the break (leave, park, reform; ``report.inplace`` reads them so)."""
    fault = next((e for e in events if e["event"] == "fault"), None)
    if fault is None:
        return {"fired": False}
    t = fault["t"]

    def first(kind: str) -> dict | None:
        return next((e for e in events if e["event"] == kind and e["t"] >= t and e.get("pid") not in lost_pids), None)

    def since(e: dict | None, back: float = 0.0) -> float | None:
        return round(e["t"] - back - t, 3) if e else None

    reformed, finished, step = first("reformed"), first("finished"), first("step")
    phases = (reformed or {}).get("phases_s") or {}
    return {"fired": True, "after_step": fault.get("step"),
            "to_detected_s": since(reformed, sum(phases.values())) if phases else None,
            "to_placed_s": since(reformed, phases.get("reform", 0.0)) if phases else None,
            "to_reformed_s": since(reformed), "reformed_phases_s": phases or None,
            "to_finished_s": since(finished), "finished_phases_s": (finished or {}).get("phases_s"),
            "to_next_step_s": since(step)}


def gap_figures(events: list[dict], lost_pids: set[int]) -> dict:
    """The intervals between consecutive step events of healthy processes: the longest during
    the loss, the longest of the run and the median (``gaps.figures``, in seconds)."""
    points = sorted((e["t"], e["step"]) for e in events
                    if e["event"] == "step" and e.get("pid") not in lost_pids)
    fault = next((e for e in events if e["event"] == "fault"), None)
    gaps = [(b[0] - a[0], a[1], b[1], b[0]) for a, b in itertools.pairwise(points)]
    return gaps_during.figures([gaps], fault["t"] if fault else None)


def batch_figures(records: list[dict], counts: dict[int, str], steps: int, global_batch: int) -> dict:
    """Did every step's counting records hold exactly its global batch's positions?"""
    held: dict[int, list[int]] = {}
    for r in records:
        if r["generation"] == counts[r["step"]]:
            held.setdefault(r["step"], []).extend(r["positions"])
    short = [s for s in range(1, steps + 1)
             if sorted(held.get(s, [])) != list(range((s - 1) * global_batch, s * global_batch))]
    return {"global_batch_held": not short, "steps_not_whole": short[:20],
            "completed": all(s in held for s in range(1, steps + 1))}
