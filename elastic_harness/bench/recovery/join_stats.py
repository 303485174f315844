"""Pure: what ``bench recovery`` reports about a node joining a running job, from its events.

A join (``add-node``: scale-up, or a replacement) is measured from the new node's *arrival*,
its agent's first attempt to join the rendezvous (torchelastic's ``next_rendezvous``
event; the agent's ``start`` event when that was not bridged), to the first step completed
at the new world size. Starting the node before that (the agent's and its worker zygote's
imports) is reported apart (``boot_s``) and not counted in ``join_s``; ``paused_s`` is the
time training stood still, from the last step before the new generation to its first
step. Consecutive phases, each between two moments the events record:

- ``notice``: until the running generation drained (``drain`` event): its agent saw a node
  waiting and asked its workers to stop at the next step, save and exit;
- ``rendezvous``: until torchelastic completed the round with the new node (this includes
  the drain's save and the old workers exiting);
- ``spawn``: until the new rank 0 began to form its process group (``rendezvous`` event's
  time less its ``pg_init_s``);
- ``process_group``: ``pg_init_s``;
- ``restore``: until the ``resume`` event (its ``source``: ``peer`` when the joiner received
  the state over the network, ``storage`` when every rank loaded the drain's checkpoint);
- ``first_step``: until that generation's first ``step`` event.

A phase whose end was not recorded is None and the next recorded one spans the gap.

The restore phase is split further: ``before_load_s`` (restore less ``load_s``: building the
run, and for storage listing and verifying the checkpoint) and, for a restore from memory,
``tier_phases_s``: rank 0's seconds per phase of ``MemoryTier.restore`` (offers, layout,
transfer, load, keep; the ``resume`` event's ``phases_s``).
"""

from __future__ import annotations

from collections.abc import Sequence

from elastic_harness.bench.recovery.crash_stats import median_of
from elastic_harness.records.goodput import RDZV_COMPLETE

JOIN = "_Handler.next_rendezvous"  # torchelastic's: a node attempts to join (and later: joined)
PHASES = ("notice", "rendezvous", "spawn", "process_group", "restore", "first_step")


def _first(events: Sequence[dict], after: float, pred) -> dict | None:
    return next((e for e in events if e["t"] >= after and pred(e)), None)


def join_moments(events: Sequence[dict], fault: dict) -> dict[str, float | None]:
    """Absolute times of the join that ``fault`` (an ``add-node`` fault event) started; None
    for a moment not recorded. ``arrival`` is the new node's agent ``start`` event; the
    generation it joined is the one whose rank 0 formed its group nearest to the new node's
    first ``worker`` event (all ranks form it together). A join that fell into a round a
    failure opened has no drain of its own: ``notice`` is then None."""
    node = str(fault.get("node", ""))
    up = _first(events, fault["t"], lambda e: e["event"] == "start" and e.get("who") == "agent"
                and str(e.get("node", "")) == node)
    arrived = up and (_first(events, up["t"], lambda e: e["event"] == "torchelastic" and e.get("pid") == up["pid"]
                             and str(e.get("name", "")).endswith(JOIN)) or up)
    base = arrived["t"] if arrived else fault["t"]
    joined = _first(events, base, lambda e: e["event"] == "worker" and str(e.get("node", "")) == node)
    rounds = [e for e in events if e["event"] == "rendezvous" and e["t"] >= base]
    formed = min(rounds, key=lambda e: abs(e["t"] - joined["t"])) if joined and rounds else None
    end = formed["t"] if formed else base  # never joined: no phase of it (a later drain is not its)
    drained = _first(events, base, lambda e: e["event"] == "drain" and e["t"] <= end)
    done = [e for e in events if base <= e["t"] <= end and e["event"] == "torchelastic"
            and str(e.get("name", "")).endswith(RDZV_COMPLETE)]
    drained = drained if formed else None
    resume = formed and _first(events, formed["t"], lambda e: e["event"] == "resume" and e["pid"] == formed["pid"])
    step = resume and _first(events, resume["t"], lambda e: e["event"] == "step" and e["pid"] == resume["pid"])
    last = [e["t"] for e in events if e["event"] == "step" and formed and e["t"] <= formed["t"]]
    return {"fault": fault["t"], "arrival": arrived and arrived["t"], "notice": drained and drained["t"],
            "last_step": last[-1] if last else None,
            "rendezvous": done[-1]["t"] if done and formed else None,
            "spawn": formed["t"] - float(formed.get("pg_init_s") or 0.0) if formed else None,
            "process_group": formed and formed["t"], "restore": resume and resume["t"],
            "first_step": step and step["t"], "_formed": formed, "_resume": resume}


def join_record(events: Sequence[dict], fault: dict) -> dict:
    """One join: ``join_s`` (arrival to the first step at the new size), ``boot_s``, the
    phases, and what the new generation restored from (``source``, ``load_s``, sizes)."""
    m = join_moments(events, fault)
    formed, resume, last_step = m.pop("_formed"), m.pop("_resume"), m.pop("last_step")
    arrival = m["arrival"]
    phases: dict[str, float | None] = {}
    last = arrival
    for phase in PHASES:
        end = m[phase]
        phases[phase] = None if end is None or last is None else round(end - last, 4)
        last = end if end is not None else last
    done = m["first_step"]
    return {
        "node": str(fault.get("node", "")), "step": fault.get("step"),
        "join_s": None if done is None or arrival is None else round(done - arrival, 4),
        "boot_s": None if arrival is None else round(arrival - m["fault"], 4),
        "paused_s": None if done is None or last_step is None else round(done - last_step, 4),
        "phases_s": phases,
        "source": resume.get("source", "fresh" if resume.get("fresh") else None) if resume else None,
        "load_s": resume.get("load_s") if resume else None,
        "before_load_s": (round(phases["restore"] - resume["load_s"], 4)
                          if resume and phases["restore"] is not None and resume.get("load_s") is not None else None),
        "tier_phases_s": dict(resume.get("phases_s") or {}) if resume else {},
        "world_size": formed.get("world_size") if formed else None,
        "saved_world_size": resume.get("saved_world_size") if resume else None,
    }


def joins(events: Sequence[dict]) -> list[dict]:
    """``join_record`` of every ``add-node`` fault of the run, in order."""
    return [join_record(events, f) for f in events if f["event"] == "fault" and f.get("kind") == "add-node"]


def median_phases(records: Sequence[dict]) -> dict[str, float | None]:
    """Per phase (and ``join_s``, ``paused_s``, ``boot_s``, ``load_s``, ``before_load_s``, each
    ``tier_phases_s`` phase as ``tier.NAME``), the median over the joins that recorded it."""
    out = {p: median_of([r["phases_s"].get(p) for r in records]) for p in PHASES}
    for key in ("join_s", "paused_s", "boot_s", "load_s", "before_load_s"):
        out[key] = median_of([r.get(key) for r in records])
    tier = sorted({name for r in records for name in r.get("tier_phases_s") or {}})
    for name in tier:
        out[f"tier.{name}"] = median_of([(r.get("tier_phases_s") or {}).get(name) for r in records])
    return out
