"""Draw ``report.png`` from a ``Timeline``: loss and world size over time, faults marked.

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
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 5.5), dpi=100)
    FigureCanvasAgg(fig)
    loss_ax, size_ax = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    _loss(loss_ax, tl)
    _evals(loss_ax, tl)
    _world_size(size_ax, tl)
    for ax in (loss_ax, size_ax):
        _faults(ax, tl, label=ax is loss_ax)
    g = tl.goodput
    loss_ax.set_title(title or f"goodput {g.goodput:.1%} of {g.wall_s:.0f} s; {len(tl.faults)} fault(s)")
    size_ax.set_xlabel("seconds since the run started")
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def _loss(ax, tl: Timeline) -> None:
    kept = [p for p in tl.points if p.in_lineage and p.loss is not None]
    lost = [p for p in tl.points if not p.in_lineage and p.loss is not None]
    ax.plot([p.t for p in kept], [p.loss for p in kept], ".", ms=2, color="tab:blue", label="loss")
    if lost:
        ax.plot([p.t for p in lost], [p.loss for p in lost], "x", ms=3, color="grey",
                label="loss (steps redone later)")
    ax.set_ylabel("loss")
    if kept and min(p.loss for p in kept + lost) > 0:
        ax.set_yscale("log")  # early losses would otherwise flatten the rest
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


def _faults(ax, tl: Timeline, label: bool) -> None:
    for f in tl.faults:
        color = _FAULT_COLORS.get(f.kind, "black")
        ax.axvline(f.t, color=color, ls="--", lw=1)
        if f.first_step is not None:
            ax.axvspan(f.t, f.first_step, color=color, alpha=0.08)
        if label:
            ax.annotate(f"{f.kind}:{f.target}", (f.t, 1), xycoords=("data", "axes fraction"),
                        rotation=90, va="top", ha="right", fontsize=7, color=color)
    if label and tl.points:
        ax.legend(loc="best", fontsize=8)
