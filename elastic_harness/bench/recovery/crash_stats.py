"""Pure: what ``bench recovery`` reports about worker crashes, from a run's events.

``restart_stats`` counts faults recovered (on the first try: one restart used);
``crash_summary`` adds steps redone per crash, the median phases of ``breakdown`` (and of a
fault recovered in place, ``report.inplace``'s), how each fault was recovered and the
survivors that kept their process (``kept``), and every fault's own breakdown
(``recoveries``), so that a slow one can be read after the fact.

``breakdown`` splits one fault's recovery (fault to the first completed step after it) into
consecutive phases, each between two moments the events record:

- ``detect``: the fault until the agent saw a worker exit (``workers`` state ``failed``;
  only agents with warm starts report it, torch's own process context does not say);
- ``stop``: until the rest of the group was down (``workers`` ``stopped``);
- ``rendezvous``: until torchelastic completed the next rendezvous round;
- ``spawn``: until the new rank 0 began to form its process group (its ``rendezvous``
  event's time less its ``pg_init_s``): rank assignment, starting the process, imports,
  reading the job;
- ``process_group``: ``pg_init_s`` (and agreeing on the generation id);
- ``restore``: until the ``resume`` event: building the run, model and optimizer, restoring;
- ``first_step``: until that generation's first ``step`` event.

A phase whose start or end was not recorded is None, and the next recorded phase spans the
gap (plain torchrun records neither agent nor rendezvous events, so its ``spawn`` starts at
the fault). The phases add up to the recovery time when every moment was recorded.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from elastic_harness.bench.recovery import kept
from elastic_harness.records.goodput import RDZV_COMPLETE
from elastic_harness.report import inplace
from elastic_harness.report.timeline import build

PHASES = ("detect", "stop", "rendezvous", "spawn", "process_group", "restore", "first_step")


def _first(events: Sequence[dict], after: float, pred) -> dict | None:
    return next((e for e in events if e["t"] >= after and pred(e)), None)


def moments(events: Sequence[dict], fault: dict) -> dict[str, float | None]:
    """Seconds after ``fault`` of each phase's end (None when not recorded)."""
    t0 = fault["t"]
    failed = _first(events, t0, lambda e: e["event"] == "workers" and e.get("state") == "failed")
    stopped = _first(events, t0, lambda e: e["event"] == "workers" and e.get("state") == "stopped")
    rdzv = _first(events, stopped["t"] if stopped else t0,
                  lambda e: e["event"] == "torchelastic" and e.get("name", "").endswith(RDZV_COMPLETE))
    formed = _first(events, t0, lambda e: e["event"] == "rendezvous")  # the new rank 0's
    resume = formed and _first(events, formed["t"], lambda e: e["event"] == "resume" and e["pid"] == formed["pid"])
    step = resume and _first(events, resume["t"], lambda e: e["event"] == "step" and e["pid"] == resume["pid"])
    pg_start = formed["t"] - float(formed.get("pg_init_s") or 0.0) if formed else None

    def rel(t: float | None) -> float | None:
        return None if t is None else round(t - t0, 4)

    return {"detect": rel(failed and failed["t"]), "stop": rel(stopped and stopped["t"]),
            "rendezvous": rel(rdzv and rdzv["t"]), "spawn": rel(pg_start),
            "process_group": rel(formed and formed["t"]), "restore": rel(resume and resume["t"]),
            "first_step": rel(step and step["t"])}


def breakdown(events: Sequence[dict], fault: dict) -> dict[str, float | None]:
    """Duration of each phase of recovering from ``fault`` (see the module docstring)."""
    ends = moments(events, fault)
    out: dict[str, float | None] = {}
    last = 0.0
    for phase in PHASES:
        end = ends[phase]
        out[phase] = None if end is None else round(end - last, 4)
        last = end if end is not None else last
    return out


def median_breakdown(rows: Sequence[dict[str, float | None]],
                     phases: Sequence[str] = PHASES) -> dict[str, float | None]:
    """Per phase (a restart's ``PHASES``, or others named), the median over faults that recorded it."""
    out = {}
    for phase in phases:
        xs = [r[phase] for r in rows if r.get(phase) is not None]
        out[phase] = round(statistics.median(xs), 4) if xs else None
    return out


def copy_share(events: Sequence[dict]) -> float | None:
    """The snapshot's own share of step time as the run measured it (rank 0's ``memory``
    events: median copy / (interval x median step)), median over the run's settings. Only
    the copy's wall time: what a paired comparison adds is its effect on everything else."""
    shares = [e["copy_s"] / (e["every"] * e["step_s"]) for e in events
              if e["event"] == "memory" and e.get("copy_s") and e.get("step_s") and e.get("every")]
    return round(statistics.median(shares), 4) if shares else None


def restart_stats(events: list[dict], requested: int, code: int | None,
                  kinds: tuple[str, ...] = ("kill-worker",)) -> dict:
    """Per fault of ``kinds`` (not the preempt that ends a run): recovered (a step followed),
    and on the first try (one restart used).

    The restart count a fault hit is that of the last generation formed before it (its
    ``rendezvous`` event), not of the last step: a fault before a generation's first step
    (while it starts, before step 1 of the run) hit that generation too.
    """
    tl = build(events)
    steps = [e for e in events if e["event"] == "step"]
    formed = [e for e in events if e["event"] == "rendezvous"]
    faults = [f for f in tl.faults if f.kind in kinds]
    first_try = 0
    for f in faults:
        if f.first_step is None:
            continue
        hit = [e.get("restart", 0) for e in formed if e["t"] - tl.t0 <= f.t]
        after = next((e.get("restart", 0) for e in steps if e["t"] - tl.t0 >= f.first_step), None)
        if after is not None and after - (hit[-1] if hit else 0) == 1:
            first_try += 1
    rows = [f for f in faults if f.recovery_s is not None]
    return {
        "exit": code, "requested": requested, "fired": len(faults), "recovered": len(rows),
        "recovered_first_try": first_try, "median_recovery_s": median_of([f.recovery_s for f in rows]),
        "max_recovery_s": max((f.recovery_s for f in rows), default=None),
        "finished": any(e["event"] == "finish" for e in events),
        "steps_lost": [f.steps_lost for f in faults],
    }


def crash_summary(events: list[dict], requested: int, code: int | None,
                  kinds: tuple[str, ...] = ("kill-worker",)) -> dict:
    """``restart_stats`` plus steps redone per crash, the median of each recovery phase (a
    restart's, and in place's), and per fault how it was recovered and who kept its process
    (``kept``: summed in ``kept``, each fault's in ``recoveries``)."""
    stats = restart_stats(events, requested, code, kinds)
    faults = [e for e in events if e["event"] == "fault" and e.get("kind") in kinds]
    rows = [breakdown(events, f) for f in faults]
    hows = [kept.of_fault(f.recovered_how) for f in build(events).faults if f.injected and f.kind in kinds]
    hows += [kept.of_fault(None)] * (len(faults) - len(hows))
    return {**stats, "mean_steps_lost": mean_of(stats["steps_lost"]), "median_phases_s": median_breakdown(rows),
            "median_in_place_phases_s": median_breakdown([h["in_place_phases"] for h in hows if h["in_place_phases"]],
                                                         inplace.PHASES),
            "kept": kept.tally(hows),
            "recoveries": [{**recovery(events, f, row), **how}
                           for f, row, how in zip(faults, rows, hows, strict=True)],
            "restored_from_memory": sum(1 for e in events if e["event"] == "resume" and e.get("source") == "memory")}


def recovery(events: Sequence[dict], fault: dict, phases: dict[str, float | None]) -> dict:
    """One fault's record: when and where it hit, its recovery time and ``phases``."""
    t0 = events[0]["t"] if events else fault["t"]
    return {"t": round(fault["t"] - t0, 3), "step": fault.get("step"), "target": fault.get("target"),
            "recovery_s": moments(events, fault)["first_step"], "phases_s": phases}


def median_of(xs: list) -> float | None:
    """Median of the values that are not None (3 decimals), or None."""
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 3) if xs else None


def quartiles(xs: list) -> list[float] | None:
    """[p25, p75] of the values (4 decimals): a figure's spread next to its median."""
    if len(xs) < 2:
        return None
    q = statistics.quantiles(xs, n=4)
    return [round(q[0], 4), round(q[2], 4)]


def mean_of(xs: list) -> float | None:
    """Mean of the values that are not None (3 decimals), or None."""
    xs = [x for x in xs if x is not None]
    return round(sum(xs) / len(xs), 3) if xs else None
