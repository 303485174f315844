"""Device check figures (``run.sh``): one JSON object from the runs' own events.

``python3 docs/devcheck/figures.py WORK_DIR D2H_JSON``: for the runs ``run.sh`` made under
WORK_DIR, whether each check held (finished, restored from memory, final model digest equal
to its uninterrupted reference, resumed on CPU at world size 2), the killed worker's recovery
phase by phase (``bench.recovery.crash_stats``: detect, stop, rendezvous, spawn, process_group, restore,
first_step) with NCCL's share (``process_group``: the NCCL communicator is made eagerly there),
and the memory tier's device-to-host GB/s from ``gpu_check.py``'s output.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from elastic_harness.bench.recovery.crash_stats import crash_summary
from elastic_harness.events import read_events


def summary(run: Path) -> dict:
    try:
        return json.loads((run / "summary.json").read_text())
    except (OSError, ValueError):
        return {}


def killed(run: Path, ref: Path) -> dict:
    events = read_events(run / "events.jsonl") if (run / "events.jsonl").exists() else []
    crash = crash_summary(events, 1, 0) if events else {}
    rec = (crash.get("recoveries") or [{}])[0]
    phases = rec.get("phases_s") or {}
    total = rec.get("recovery_s")
    pg = phases.get("process_group")
    digest, want = summary(run).get("model_digest"), summary(ref).get("model_digest")
    return {"finished": bool(summary(run).get("finished")), "restored_from_memory": crash.get("restored_from_memory"),
            "bit_identical": digest is not None and digest == want, "recovery_s": total, "phases_s": phases,
            "nccl_init_share": round(pg / total, 3) if pg is not None and total else None}


def main(work: Path, d2h: Path) -> dict:
    out: dict = {"ddp_kill": killed(work / "ddp_kill", work / "ddp_ref"),
                 "fsdp_bf16_kill": killed(work / "fsdp_kill", work / "fsdp_ref")}
    cpu = summary(work / "to_cpu")
    out["gpu_checkpoint_on_cpu_ws2"] = {"finished": bool(cpu.get("finished")), "world_sizes": cpu.get("world_sizes"),
                                        "resumed_from_step": cpu.get("resumed_from_step")}
    if not d2h.exists():
        out["snapshot"] = {"skipped": "gpu_check.py did not run (DEVICE=cpu, or it failed: see d2h.log)"}
        return out
    try:
        raw = json.loads(d2h.read_text())
        out["snapshot"] = {k: v for k, v in raw.items() if k.endswith("GBps") or k in (
            "gpu", "torch", "state_bytes", "restore_bit_identical", "region_registered")}
    except (OSError, ValueError) as e:
        out["snapshot"] = {"error": str(e)}
    return out


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2])), indent=1))
