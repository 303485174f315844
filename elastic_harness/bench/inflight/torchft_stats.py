"""The torchft side's figures, from its step logs and its lighthouse's log (pure but for
``report``, which reads them). Healthy groups: every group but the one killed.

- discarded micro-batches: those of the healthy groups' attempts that ``should_commit``
  refused (computed, then dropped; torchft's loader does not give them back);
- longest gap: the healthy groups' longest time between the ends of two committed steps
  during the loss (``gaps``), beside the whole run's and the median of those intervals (a
  step time);
- steps redone: per healthy group, attempts less commits (a refused step's number is tried
  again); the most over the groups;
- global batch held: every step 1..steps was committed as an update over the whole global
  batch (the samples of every group that committed it while taking part).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

from elastic_harness.bench.inflight import gaps as gaps_during

LIGHTHOUSE_LINE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}) \[\w+\] \[[\w:]+\] - (.*)$")
DECISIONS = ("Quorum status", "Detected quorum change", "Detected commit failures")


def report(scratch: Path, cfg: Any) -> dict:
    """``analyze`` of a run's scratch folder."""
    return analyze(read_records(scratch), cfg, read_lighthouse(scratch / "lighthouse.log"))


def read_records(scratch: Path) -> list[dict]:
    out = []
    for path in sorted(scratch.glob("group-*.jsonl")):
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):  # the last line of a killed group may be cut
                out.append(json.loads(line))
    return out


def read_lighthouse(path: Path) -> list[tuple[float, str]]:
    """The lighthouse's quorum decisions as (epoch seconds, text)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        m = LIGHTHOUSE_LINE.match(line)
        if m and m.group(2).startswith(DECISIONS):
            out.append((datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S.%f").timestamp(), m.group(2)))
    return out


def analyze(records: list[dict], cfg: Any, lighthouse: list[tuple[float, str]]) -> dict:
    """The figures (module doc) and what the fault did, for ``cfg``'s run (pure)."""
    steps = [r for r in records if "event" not in r]
    kill = next((r for r in records if r.get("event") == "kill"), None)
    healthy = sorted({r["group"] for r in steps} - {cfg.kill_group})
    per_group = {g: group_figures([r for r in steps if r["group"] == g]) for g in healthy}
    series = [per_group[g].pop("gaps") for g in healthy]
    refused = [r for r in steps if r["group"] in healthy and not r["committed"]]
    return {
        "discarded_micro_batches": sum(r["micro_batches"] for r in refused),
        "discarded_samples": sum(r["samples"] for r in refused),
        **gaps_during.figures(series, kill["t"] if kill else None),
        "steps_redone": max((g["attempts"] - g["commits"] for g in per_group.values()), default=0),
        "completed": bool(healthy) and all(per_group[g]["last_step"] >= cfg.steps for g in healthy),
        **global_batch(steps, cfg),
        "fault": fault(kill, steps, healthy, lighthouse),
        "per_group": per_group,
    }


def group_figures(records: list[dict]) -> dict:
    """One group's attempts, commits, last committed step, refused steps, and the intervals
    (seconds, from step, to step, when the later ended) between its consecutive commits."""
    done = sorted((r for r in records if r["committed"]), key=lambda r: r["t"])
    return {"attempts": len(records), "commits": len(done), "last_step": done[-1]["step"] if done else 0,
            "refused_steps": [r["step"] for r in records if not r["committed"]],
            "gaps": [(b["t"] - a["t"], a["step"], b["step"], b["t"]) for a, b in itertools.pairwise(done)]}


def global_batch(steps: list[dict], cfg: Any) -> dict:
    """Samples in each committed update; the steps whose update was not the global batch."""
    per_step: dict[int, int] = {}
    for r in steps:
        if r["committed"]:
            per_step[r["step"]] = per_step.get(r["step"], 0) + (r["samples"] if r["participating"] else 0)
    short = {s: n for s, n in sorted(per_step.items()) if n != cfg.global_batch}
    missing = [s for s in range(1, cfg.steps + 1) if s not in per_step]
    return {"global_batch_held": not short and not missing, "short_steps": len(short),
            "short_steps_samples": runs_of(short), "steps_never_committed": runs_of(dict.fromkeys(missing, 0))}


def runs_of(per_step: dict[int, int]) -> list[str]:
    """``{41: 15, 42: 15, 50: 0}`` as ``["41-42: 15", "50: 0"]``."""
    out: list[list[int]] = []
    for s, n in sorted(per_step.items()):
        if out and out[-1][1] == s - 1 and out[-1][2] == n:
            out[-1][1] = s
        else:
            out.append([s, s, n])
    return [f"{a}: {n}" if a == b else f"{a}-{b}: {n}" for a, b, n in out]


def fault(kill: dict | None, steps: list[dict], healthy: list[int], lighthouse: list[tuple[float, str]]) -> dict:
    """From the kill on: the healthy groups' first commit of a new step, their refused
    attempts, and the lighthouse's decisions up to its new quorum (seconds after the kill)."""
    if kill is None:
        return {"fired": False}
    t = kill["t"]
    after = sorted((r for r in steps if r["group"] in healthy and r["t"] > t), key=lambda r: r["t"])
    wanted = kill["step"] + (kill["kill_point"] == "after_step")  # in_step: the step it died in
    first = next((r for r in after if r["committed"] and r["step"] >= wanted), None)
    said = [(round(ts - t, 3), text) for ts, text in lighthouse if ts > t - 0.001]
    new = next((i for i, (_, text) in enumerate(said) if text.startswith("Detected quorum change")), None)
    return {"fired": True, "kill_point": kill["kill_point"], "at_step": kill["step"],
            "healthy_first_commit_after_s": round(first["t"] - t, 3) if first else None,
            "healthy_first_commit_step": first["step"] if first else None,
            "healthy_refused_after_kill": sum(not r["committed"] for r in after),
            "new_quorum_after_s": said[new][0] if new is not None else None,
            "lighthouse_after_kill_s": said[: (new + 1) if new is not None else 8]}


def row(out: dict, verdict: str) -> dict:
    """The bench row's four figures for this side; none unless the healthy groups finished
    (a crash is then the answer)."""
    done = verdict == "completed"
    keys = ("discarded_micro_batches", "longest_gap_s", "longest_gap_anywhere_s", "median_step_s", "steps_redone")
    return {"verdict": verdict, **{k: out[k] if done else None for k in keys},
            "global_batch_held": bool(out["global_batch_held"]) and done}
