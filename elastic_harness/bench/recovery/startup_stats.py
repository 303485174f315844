"""Pure: where a run's start-up went, from its events (``bench recovery --only churn``).

Start-up is goodput's term (``goodput``): the host's ``start`` event to the first active
generation's ``resume``. Consecutive phases, each ending at a moment the events record
(a phase whose end was not recorded is None, and the next recorded one spans the gap):

- ``agents``: until the last of the initial agents' ``start`` events (each agent's
  interpreter and its ``import torch``; its zygote imports meanwhile);
- ``rendezvous``: until torchelastic completed the first round (``_mark_rendezvous_complete``);
- ``spawn``: until the last node's ``workers`` ``started`` event of that round (forking
  waits for the zygote's imports to finish);
- ``worker_init``: until the first generation's rank 0 began to form its process group
  (its ``rendezvous`` event less ``pg_init_s``);
- ``process_group``: ``pg_init_s`` (it includes waiting for the slowest node's workers);
- ``build_restore``: until that generation's ``resume`` event (model, optimizer, restore).
"""

from __future__ import annotations

from collections.abc import Sequence

from elastic_harness.records.goodput import RDZV_COMPLETE

PHASES = ("agents", "rendezvous", "spawn", "worker_init", "process_group", "build_restore")


def startup_phases(events: Sequence[dict]) -> dict:
    """The first invocation's start-up, split into ``PHASES`` (seconds, rounded to ms), and
    ``total_s``; an empty dict if the run never resumed."""
    host = next((e for e in events if e["event"] == "start" and e.get("who") == "host"), None)
    resume = next((e for e in events if e["event"] == "resume" and host and e["t"] >= host["t"]), None)
    if host is None or resume is None:
        return {}
    t0, end = host["t"], resume["t"]
    before = [e for e in events if t0 <= e["t"] <= end]
    agents = [e["t"] for e in before if e["event"] == "start" and e.get("who") == "agent"]
    complete = next((e["t"] for e in before if e["event"] == "torchelastic"
                     and str(e.get("name", "")).endswith(RDZV_COMPLETE)), None)
    started: dict[str, float] = {}
    for e in before:
        if e["event"] == "workers" and e.get("state") == "started":
            started.setdefault(str(e.get("node")), e["t"])
    formed = next((e for e in before if e["event"] == "rendezvous" and e.get("pid") == resume.get("pid")), None)
    pg = formed.get("pg_init_s") if formed else None
    moments = [max(agents) if agents else None, complete, max(started.values()) if started else None,
               formed["t"] - pg if formed and pg is not None else None, formed["t"] if formed else None, end]
    out, last = {}, t0
    for name, t in zip(PHASES, moments, strict=True):
        out[name] = None if t is None else round(max(0.0, t - last), 3)
        last = t if t is not None else last
    return {"phases_s": out, "total_s": round(end - t0, 3)}


def drain_saves(events: Sequence[dict]) -> dict:
    """Where each drain kept the state (the ``drain`` event's ``saved``: ``memory`` when it
    drained only for a node joining and memory covers the next restore, else ``storage``),
    the run's stop apart: the last drain when no step followed it (a churn run ends by a
    drain, which saves to storage). ``storage_writes`` counts the others' storage saves."""
    drains = [e for e in events if e["event"] == "drain"]
    last_step = max((e["step"] for e in events if e["event"] == "step"), default=None)
    stop = drains[-1] if drains and last_step is not None and drains[-1]["step"] >= last_step else None
    joins = [e for e in drains if e is not stop]
    saved = [str(e.get("saved", "storage")) for e in joins]
    return {"memory": saved.count("memory"), "storage_writes": saved.count("storage"),
            "stop": None if stop is None else str(stop.get("saved", "storage"))}
