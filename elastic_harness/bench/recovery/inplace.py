"""``bench recovery --only in-place``: a node loss recovered in place against the same fault
recovered by the warm restart (``recovery: restart``), at several sizes, side by side.

For each N of ``--sizes`` (default 2, 4 and 8 nodes of one rank each; node 1 SIGKILLed at
step 40, ``nodeloss.harness``), every repeat runs both sides on every placement this machine
has (``nodeloss.rows_for``: every node on this host, and, as root, each node a simulated host
of its own): in place first in even repeats, the restart first in odd ones, so that neither
always runs on a machine the other just warmed or loaded. Each run (``nodeloss.measure``): the
fault to the first step after it (``report``), the whole machine's CPU seconds in that window
(``bench.cpuwindow``), the load average when it started, and from its events how the fault was
recovered: in place (``repoint``, ``rerun``) or restarted, the survivors whose pid is the same
after the fault against the survivors there were, and whether the in-place path fell back
(``report.inplace``, ``kept``).

Per N, placement and side: the medians, the phases, the survivors kept and the falls back
(``nodeloss.summarize``; a run whose fault hit fewer than N nodes, one having missed the
first rendezvous round, is kept out of them and listed apart: ``row_at_size``); then the ratios the goals name, judged on the medians (``scaling``,
``goals``), in place:

- node loss at the largest N / at the smallest (8 / 2)                              <= 1.5
- the machine's CPU seconds from the fault to the first step, largest N / smallest    <= 2
- node loss at 2 nodes, each placement                                            <= 0.08 s
- every survivor of every in-place fault kept its process; no fault fell back

and the same ratios for the restart, beside them. A ratio that cannot be formed (a size not
run, a side with no recovered run) is None and its goal says why.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from elastic_harness.bench import cpuwindow
from elastic_harness.bench.recovery import nodeloss
from elastic_harness.bench.recovery.launching import BenchJob, write_job

SIDES = ("in_place", "restart")  # the job's ``recovery`` setting, as the JSON names each side
SIZES = (2, 4, 8)
GOAL_SCALING = 1.5  # node loss at 8 nodes / at 2 nodes, in place
GOAL_CPU_SCALING = 2.0  # CPU seconds, fault to the first step, at 8 nodes / at 2 nodes
GOAL_TWO_NODES_S = 0.08  # node loss at 2 nodes, in place, same host and separate hosts


def parse_sizes(text: str) -> list[int]:
    """Pure: ``--sizes 2,4,8`` -> [2, 4, 8] (sorted, each at least 2: a node loss needs a
    survivor); ValueError with the reason otherwise."""
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--sizes '{text}': not a list of whole numbers") from None
    if not sizes or sizes[0] < 2:
        raise ValueError(f"--sizes '{text}': each size needs 2 nodes or more (a node loss needs a survivor)")
    return sizes


def order(repeat: int) -> tuple[str, ...]:
    """Pure: which side runs first in this repeat (they alternate)."""
    return SIDES if repeat % 2 == 0 else SIDES[::-1]


def bench_in_place(scratch: Path, repeats: int, sizes: Sequence[int], parallelism: str = "ddp") -> dict:
    """Every repeat, every size, every placement: both sides (module doc)."""
    placements = nodeloss.rows_for(os.geteuid() == 0)
    runs: dict[str, dict[str, dict[str, list]]] = {
        str(n): {p: {side: [] for side in SIDES} for p in placements} for n in sizes}
    for r in range(repeats):
        for n in sizes:
            job = nodeloss._one_rank_per_node(write_job(scratch / f"in-place-{n}.yaml",
                                                        BenchJob(steps=100, max_restarts=3, max_nodes=n,
                                                                 every=50, parallelism=parallelism)))
            for placement in placements:
                for side in order(r):
                    run_dir = scratch / f"in-place-{n}-{placement}-{side}-{r}"
                    load = round(os.getloadavg()[0], 2)
                    with cpuwindow.Sampler() as cpu:
                        code = nodeloss.harness(job, run_dir, n, "kill-node", separate=placement == "separate_hosts",
                                                sets=(f"recovery={side}",))
                    runs[str(n)][placement][side].append(
                        {**nodeloss.measure(run_dir, code, samples=cpu.samples), "load": load, "first": side == order(r)[0]})
    rows = {n: {p: {side: row_at_size(v, int(n)) for side, v in by_side.items()} for p, by_side in by_p.items()}
            for n, by_p in runs.items()}
    if "separate_hosts" not in placements:
        for by_p in rows.values():
            by_p["separate_hosts"] = {"skipped": "needs root (network, pid and UTS namespaces)"}
    out = {"fault": f"kill-node:1@{nodeloss.FAULT_STEP}", "sizes": list(sizes), "nproc_per_node": 1,
           "repeats": repeats, "parallelism": parallelism, "sides": {s: f"recovery: {s}" for s in SIDES},
           "order": "the sides alternate which runs first, repeat by repeat", "rows": rows}
    out["scaling"] = scaling(rows, sizes)
    return {**out, **goals(rows, out["scaling"], sizes)}


def row_at_size(runs: list[dict], n: int) -> dict:
    """Pure: one row's statistics (``nodeloss.summarize``) over the runs whose fault hit a
    world of ``n`` (a node that missed the first rendezvous round under load joins later, or
    never: that run measured a smaller job); the others are listed apart, with why."""
    short = [r for r in runs if r.get("world_size_before") != n]
    row = nodeloss.summarize([r for r in runs if r not in short], [])
    if short:
        row["not_at_size"] = {"why": f"the fault hit a world smaller than {n} (a node had not joined yet)",
                              "world_sizes": [r.get("world_size_before") for r in short], "runs": short}
    return row


def scaling(rows: dict, sizes: Sequence[int]) -> dict:
    """Pure: per placement and side, the largest size's median over the smallest's: the
    recovery time (``time``) and the machine's CPU seconds (``cpu_s``); None where either is
    missing (a size not run, a row skipped, nothing recovered)."""
    small, large = str(min(sizes)), str(max(sizes))
    out: dict = {"of": f"{large} nodes / {small} nodes"}
    for placement in ("same_host", "separate_hosts"):
        for side in SIDES:
            lo = rows.get(small, {}).get(placement, {}).get(side, {})
            hi = rows.get(large, {}).get(placement, {}).get(side, {})
            out[f"{placement}_{side}"] = {"time": _ratio(hi.get("median_s"), lo.get("median_s")),
                                          "cpu_s": _ratio(hi.get("cpu_s_median"), lo.get("cpu_s_median"))}
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def goals(rows: dict, ratios: dict, sizes: Sequence[int]) -> dict:
    """Pure: the goals (module doc), each judged on the medians, and why one is not judged."""
    out: dict = {}
    span = min(sizes) == 2 and max(sizes) == 8
    why = None if span else f"needs --sizes with 2 and 8 (ran {','.join(map(str, sizes))})"
    for placement in ("same_host", "separate_hosts"):
        got = ratios[f"{placement}_in_place"]
        skipped = "skipped" in rows[str(min(sizes))].get(placement, {})
        for name, value, bound in (("scaling", got["time"], GOAL_SCALING), ("cpu_scaling", got["cpu_s"], GOAL_CPU_SCALING)):
            out[f"{placement}_{name}"] = _judge(value, bound, why or ("row skipped" if skipped else None))
        two = rows.get("2", {}).get(placement, {}).get("in_place", {}).get("median_s")
        out[f"{placement}_two_nodes_s"] = _judge(two, GOAL_TWO_NODES_S, "needs 2 in --sizes" if "2" not in rows
                                                 else ("row skipped" if skipped else None))
    tallies = [side["in_place"]["kept"] for by_p in rows.values() for side in by_p.values() if "in_place" in side]
    every = [t["every_survivor_kept"] for t in tallies if t["every_survivor_kept"] is not None]
    out["every_survivor_kept"] = {"met": bool(every) and all(every) and all(t["not_recovered"] == 0 for t in tallies),
                                  "survivors": sum(t["survivors"] for t in tallies),
                                  "kept": sum(t["survivors_kept"] for t in tallies)}
    out["no_fall_back"] = {"met": bool(tallies) and sum(t["fell_back"] for t in tallies) == 0,
                           "fell_back": sum(t["fell_back"] for t in tallies),
                           "faults": sum(t["faults"] for t in tallies)}
    judged = [g["met"] for g in out.values() if g["met"] is not None]
    return {"goals": out, "met": bool(judged) and all(judged),
            "not_judged": sorted(name for name, g in out.items() if g["met"] is None)}


def _judge(value: float | None, bound: float, skipped: str | None) -> dict:
    """Pure: one goal: ``value`` <= ``bound``; not judged (met None) with the reason."""
    if skipped or value is None:
        return {"value": value, "goal": f"<= {bound}", "met": None, "skipped": skipped or "nothing recovered"}
    return {"value": value, "goal": f"<= {bound}", "met": value <= bound}
