"""Pure: the events of one invocation -> ``summary.json``."""

from __future__ import annotations

from collections.abc import Sequence


def current_invocation(events: Sequence[dict]) -> list[dict]:
    """Events since the last host ``start`` (a run dir accumulates invocations)."""
    starts = [i for i, e in enumerate(events) if e.get("event") == "start" and e.get("who") == "host"]
    return list(events[starts[-1]:]) if starts else list(events)


def summarize(events: Sequence[dict]) -> dict:
    ev = current_invocation(events)
    steps = [e for e in ev if e["event"] == "step"]
    finish = next((e for e in reversed(ev) if e["event"] == "finish"), None)
    resumes = [e for e in ev if e["event"] == "resume"]
    world_sizes: list[int] = []
    for e in ev:
        if e["event"] == "rendezvous" and (not world_sizes or world_sizes[-1] != e["world_size"]):
            world_sizes.append(e["world_size"])
    ckpts = [e for e in ev if e["event"] == "checkpoint"]
    first_resume = resumes[0] if resumes else {}
    t0, t1 = (ev[0]["t"], ev[-1]["t"]) if ev else (0.0, 0.0)
    return {
        "finished": finish is not None,
        "steps": finish["step"] if finish else (steps[-1]["step"] if steps else 0),
        "final_loss": finish["loss"] if finish else (steps[-1]["loss"] if steps else None),
        "first_loss": steps[0]["loss"] if steps else None,
        "restarts": max(0, len(resumes) - 1),
        "world_sizes": world_sizes,
        "samples_consumed": finish["samples"] if finish else (steps[-1]["samples"] if steps else 0),
        "resumed_from_step": None if first_resume.get("fresh") else first_resume.get("step"),
        "checkpoints_written": len(ckpts),
        "last_checkpoint": ckpts[-1]["path"] if ckpts else None,
        "failures": [e.get("message", "") for e in ev if e["event"] == "failure"],
        "wall_s": round(t1 - t0, 3),
        "model_digest": finish["digest"] if finish else None,
    }
