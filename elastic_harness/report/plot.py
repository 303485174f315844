"""Draw ``report.png`` from a ``Timeline``: loss and world size over time, faults marked.

The loss is drawn as a smoothed line (``smooth``: a centred moving average) over the raw
points, drawn faint; steps that a crash made the job redo are grey crosses. Fault labels
sit in a strip above the loss plot, staggered when close, never over the data.

Uses matplotlib's Agg backend (files only, no display), selected without touching the
global default, so importing this module never changes how a user's own plots behave.
"""

from __future__ import annotations

from pathlib import Path

from elastic_harness.report.timeline import Timeline

_FAULT_COLORS = {"kill-worker": "tab:red", "kill-node": "darkred", "preempt": "tab:orange",
                 "hang": "tab:purple", "add-node": "tab:green"}


def draw(tl: Timeline, path: Path, title: str = "") -> Path:
    """Write the figure to ``path`` (PNG) and return it."""
    figure(tl, title).savefig(path, format="png")
    return path


def figure(tl: Timeline, title: str = ""):
    """The report's matplotlib ``Figure``: a fault-label strip, the loss, the world size."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    label_ax, loss_ax, size_ax = fig.subplots(
        3, 1, sharex=True, gridspec_kw={"height_ratios": [0.45, 3, 1]})
    _loss(loss_ax, tl)
    _evals(loss_ax, tl)
    _world_size(size_ax, tl)
    for ax in (loss_ax, size_ax):
        _faults(ax, tl)
    _fault_labels(label_ax, tl)
    if tl.points:
        loss_ax.legend(loc="upper right", fontsize=8)
    g = tl.goodput
    label_ax.set_title(title or f"goodput {g.goodput:.1%} of {g.wall_s:.0f} s; {len(tl.faults)} failure(s)")
    size_ax.set_xlabel("seconds since the run started")
    return fig


def smooth(values: list[float], window: int) -> list[float]:
    """Pure: the centred moving average over ``window`` points (fewer at the ends)."""
    half = max(window, 1) // 2
    prefix = [0.0]
    for v in values:
        prefix.append(prefix[-1] + v)
    out = []
    for i in range(len(values)):
        lo, hi = max(0, i - half), min(len(values), i + half + 1)
        out.append((prefix[hi] - prefix[lo]) / (hi - lo))
    return out


def _loss(ax, tl: Timeline) -> None:
    kept = sorted((p for p in tl.points if p.in_lineage and p.loss is not None), key=lambda p: p.t)
    lost = [p for p in tl.points if not p.in_lineage and p.loss is not None]
    xs, ys = [p.t for p in kept], [p.loss for p in kept]
    ax.plot(xs, ys, ".", ms=3, color="tab:blue", alpha=0.25, label="loss (each logged step)")
    if len(kept) > 2:
        ax.plot(xs, smooth(ys, max(5, len(kept) // 12)), "-", lw=1.8, color="tab:blue",
                label="loss (moving average)")
    if lost:
        ax.plot([p.t for p in lost], [p.loss for p in lost], "x", ms=3, color="grey",
                label="loss (steps redone later)")
    ax.set_ylabel("loss")
    if kept and min(p.loss for p in kept + lost) > 0:
        from matplotlib.ticker import LogFormatter

        ax.set_yscale("log")  # early losses would otherwise flatten the rest
        ax.yaxis.set_major_formatter(LogFormatter(labelOnlyBase=False))
        ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    ax.grid(alpha=0.3)


def _evals(ax, tl: Timeline) -> None:
    """Evaluation metrics: losses on the loss axis, anything else (accuracy...) on its own."""
    names = sorted({k for e in tl.evals for k in e.metrics})
    other = None
    for i, name in enumerate(names):
        pts = [(e.t, e.metrics[name]) for e in tl.evals if name in e.metrics]
        target = ax if "loss" in name else (other := other or ax.twinx())
        target.plot([t for t, _ in pts], [v for _, v in pts], "o-", ms=4, lw=1,
                    color=f"C{(i + 2) % 10}", label=f"eval {name}")
    if other is not None:
        other.set_ylabel("eval metric")
        other.legend(loc="center right", fontsize=8)


def _world_size(ax, tl: Timeline) -> None:
    """Each generation's world size while it trained; 0 between generations (no training)."""
    xs: list[float] = [0.0]
    ys: list[int] = [0]
    for gen in sorted({p.generation for p in tl.points}):
        pts = [p for p in tl.points if p.generation == gen and p.world_size is not None]
        if pts:
            xs += [pts[0].t, pts[-1].t]
            ys += [pts[0].world_size, 0]
    ax.step(xs, ys, where="post", color="tab:green")
    ax.set_ylabel("world size")
    top = max(ys)
    ax.set_ylim(0, top + 1)
    ax.set_yticks(range(0, top + 2))
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)


def _faults(ax, tl: Timeline) -> None:
    for f in tl.faults:
        color = _FAULT_COLORS.get(f.kind, "black")
        ax.axvline(f.t, color=color, ls="--", lw=1)
        if f.first_step is not None:
            ax.axvspan(f.t, f.first_step, color=color, alpha=0.08)


def label_rows(times: list[float], span: float, gap: float = 0.06) -> list[int]:
    """Pure: a row (0, 1, 2) per label so that labels closer than ``gap`` of the ``span``
    do not overprint each other (times in order)."""
    rows, last = [], {}
    for t in times:
        row = next((r for r in range(3) if t - last.get(r, -span) >= gap * span), len(rows) % 3)
        last[row] = t
        rows.append(row)
    return rows


def _fault_labels(ax, tl: Timeline) -> None:
    """Fault names in their own strip above the loss plot, at the fault's time."""
    ax.set_ylim(0, 3)
    ax.set_yticks([])
    ax.tick_params(axis="x", which="both", bottom=False, labelbottom=False)
    for side in ("top", "right", "left", "bottom"):
        ax.spines[side].set_visible(False)
    faults = sorted(tl.faults, key=lambda f: f.t)
    span = max([p.t for p in tl.points] + [f.t for f in faults] + [1.0])
    for f, row in zip(faults, label_rows([f.t for f in faults], span), strict=True):
        color = _FAULT_COLORS.get(f.kind, "black")
        ax.plot([f.t, f.t], [0, 2.2 - 0.9 * row], color=color, lw=0.8, ls=":")
        ax.text(f.t, 2.3 - 0.9 * row, f"{f.kind}:{f.target}" + (f" @{f.step}" if f.step is not None else ""),
                ha="center", va="center", fontsize=7, color=color,
                bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none"})
