"""The run directory: create it, prove it writable, record the resolved spec.

Nothing here deletes: ``--fresh`` moves earlier checkpoints and events aside.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from elastic_harness.errors import RunDirError
from elastic_harness.spec import JobSpec, dump_job

RESOLVED = "job.resolved.yaml"


def prepare(run_dir: Path, spec: JobSpec, fresh: bool = False) -> Path:
    run_dir = Path(run_dir).resolve()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise RunDirError(
            f"run directory '{run_dir}' is not writable: {e.strerror}",
            "pass --run-dir to a directory you can write, or fix its permissions",
        ) from None
    if fresh:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for name in ("checkpoints", "events.jsonl", "summary.json", "samples"):
            if (run_dir / name).exists():
                os.replace(run_dir / name, run_dir / f"{name}.old-{stamp}")
    write_resolved(run_dir, spec)
    return run_dir


def write_resolved(run_dir: Path, spec: JobSpec) -> Path:
    """Atomically (several agents may write the same content)."""
    final = run_dir / RESOLVED
    tmp = run_dir / f".{RESOLVED}.{os.getpid()}"
    tmp.write_text(dump_job(spec))
    os.replace(tmp, final)
    return final
