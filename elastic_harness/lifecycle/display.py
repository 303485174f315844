"""Pure: a ``JobStatus`` as the lines ``status`` prints and the rows ``list`` prints."""

from __future__ import annotations

import time
from collections.abc import Sequence

from elastic_harness.lifecycle.state import JobStatus


def _num(value: object, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def _wall(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else (f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{seconds:.0f}s")


def _step(st: JobStatus) -> str:
    return f"{_num(st.step)}/{st.total_steps}" if st.total_steps else _num(st.step)


def detail(st: JobStatus) -> str:
    """``status JOB``: one field per line."""
    checkpoint = "-" if st.last_checkpoint_step is None else f"step {st.last_checkpoint_step}" + (
        f" ({st.last_checkpoint})" if st.last_checkpoint else "")
    submitted = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(st.submitted)) if st.submitted else "-"
    rows = [
        ("job", f"{st.id} ({st.name}, {st.scheduler})"),
        ("state", st.state + (f": {st.reason}" if st.reason else "")),
        ("step", f"{_step(st)}  loss {_num(st.loss, '{:.6g}')}"),
        ("world", f"{_num(st.world_size)} ranks on {_num(st.nodes)} nodes"),
        ("restarts", f"{_num(st.restarts)}  recoveries {_num(st.recoveries)}"),
        ("checkpoint", checkpoint),
        ("wall", _wall(st.wall_s)),
        ("submitted", submitted),
        ("where", st.where or "-"),
    ]
    if st.run_dir:
        rows.append(("run dir", st.run_dir))
    if st.exit_code is not None:
        rows.append(("exit code", str(st.exit_code)))
    if st.model_digest:
        rows.append(("digest", st.model_digest))
    return "\n".join(f"{k:<11}{v}" for k, v in rows)


_COLUMNS = ("ID", "STATE", "STEP", "LOSS", "WORLD", "RESTARTS", "WALL", "SCHEDULER", "RUN DIR")


def table(statuses: Sequence[JobStatus]) -> str:
    """``list``: one row per job, oldest first."""
    rows = [_COLUMNS] + [
        (st.id, st.state, _step(st), _num(st.loss, "{:.4g}"), _num(st.world_size), _num(st.restarts),
         _wall(st.wall_s), st.scheduler, st.run_dir or st.where)
        for st in statuses
    ]
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(_COLUMNS) - 1)]
    return "\n".join("  ".join(f"{str(c):<{w}}" for c, w in zip(r, widths, strict=False)) + f"  {r[-1]}"
                     for r in rows)
