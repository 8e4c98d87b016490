"""Matplotlib figures of the analysis tables, drawn on the Agg canvas (no display, no pyplot).

Each function takes the frames `fibray.analysis` returns and gives back a Figure; it
never queries the store itself, so notebooks and the report draw the same pictures.
Figures are built without pyplot, so nothing global (backend, open figures) is touched.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import polars as pl
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from fibray.analysis import CATEGORIES

# Beyond these, a figure shows the first panels / best lines and says what it left out.
MAX_PANELS = 12
MAX_LINES = 8

# Status category colours: green for passed, warm colours for failures.
CATEGORY_COLORS = {
    "passed": "#2e7d32", "compile": "#6a1b9a", "runtime": "#c62828", "numerical": "#ef6c00",
    "shape": "#f9a825", "dtype": "#8d6e63", "timeout": "#1565c0", "other": "#9e9e9e",
}


def _grid(n: int, cols: int = 3, cell: tuple[float, float] = (5.2, 3.8)) -> tuple[Figure, list]:
    cols = max(1, min(cols, n))
    rows = max(1, math.ceil(n / cols))
    fig = _figure((cell[0] * cols, cell[1] * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def _log_ticks(ax, which: str, suffix: str = "") -> None:
    """Log ticks labelled as plain numbers (0.5x, 1x, 2x): 1-2-5 per decade, fewer over a wide range."""
    axis = ax.xaxis if which == "x" else ax.yaxis
    low, high = ax.get_xlim() if which == "x" else ax.get_ylim()
    decades = math.log10(high / low) if low > 0 and high > low else 1.0
    subs = (1.0, 2.0, 5.0) if decades <= 2 else (1.0, 3.0) if decades <= 3.5 else (1.0,)
    axis.set_major_locator(LogLocator(base=10, subs=subs))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}{suffix}"))
    axis.set_minor_formatter(NullFormatter())


def _figure(size: tuple[float, float]) -> Figure:
    fig = Figure(figsize=size, layout="constrained")  # keeps suptitles and outside legends clear
    FigureCanvasAgg(fig)
    return fig


def _empty(message: str) -> Figure:
    fig = _figure((6, 2))
    ax = fig.subplots()
    ax.axis("off")
    ax.text(0.5, 0.5, message, ha="center", va="center")
    return fig


def _short(name: str, definition: str) -> str:
    """A solution name without its definition's prefix, for legends."""
    return name[len(definition) + 1:] if name.startswith(definition + "_") and len(name) > len(definition) + 1 else name


def _legend_below(ax, n: int) -> None:
    if n:
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2, frameon=False)


def _panels_note(shown: int, total: int) -> str:
    return f" (first {shown} of {total} panels)" if total > shown else ""


def fast_p_figure(curve: pl.DataFrame, label: str = "solution") -> Figure:
    """One panel per definition: fast_p against the threshold p (log axis), a line per `label`.

    Lines that are zero everywhere (never passed) are left out and counted; past MAX_LINES
    only the best (largest area under the curve) are drawn.
    """
    if curve.is_empty():
        return _empty("no evaluations")
    definitions = curve["definition"].unique().sort().to_list()
    fig, axes = _grid(min(len(definitions), MAX_PANELS), cell=(5.6, 5.0))
    for ax, definition in zip(axes, definitions):
        part = curve.filter((pl.col("definition") == definition) & (pl.col("p") > 0))
        area = part.group_by(label).agg(pl.col("fast_p").sum().alias("area")).sort(["area", label], descending=[True, False])
        never = area.filter(pl.col("area") == 0).height
        drawn = area.filter(pl.col("area") > 0).head(MAX_LINES)[label].to_list()
        for name in drawn:
            line = part.filter(pl.col(label) == name).sort("p")
            ax.step(line["p"].to_list(), line["fast_p"].to_list(), where="post", linewidth=1.8,
                    label=_short(str(name), definition))
        ax.axvline(1.0, color="grey", linestyle="--", linewidth=0.8)
        hidden = area.height - never - len(drawn)
        notes = ([f"{hidden} more not shown"] if hidden else []) + ([f"{never} never passed"] if never else [])
        if notes:
            ax.text(0.02, 0.03, "; ".join(notes), transform=ax.transAxes, ha="left", va="bottom", fontsize=8,
                    color="#555")
        ax.set_xscale("log")
        _log_ticks(ax, "x", "×")
        ax.set_ylim(-0.03, 1.05)
        ax.set_title(definition, fontsize=10)
        ax.set_xlabel("p (speedup threshold; dashed: p = 1)")
        ax.set_ylabel("fast_p")
        ax.grid(True, which="both", alpha=0.3)
        _legend_below(ax, len(drawn))
    fig.suptitle("fast_p: share of workloads PASSED and more than p× faster than the reference"
                 + _panels_note(len(axes), len(definitions)))
    return fig


def speedup_by_axis_figure(series: pl.DataFrame, label: str = "solution") -> Figure:
    """One panel per (definition, var axis): geomean speedup of PASSED evaluations against the axis value."""
    if series.is_empty():
        return _empty("no PASSED evaluations with numeric var axes")
    panels = series.select("definition", "axis").unique().sort("definition", "axis").rows()
    fig, axes = _grid(min(len(panels), MAX_PANELS), cell=(5.6, 4.6))
    for ax, (definition, axis) in zip(axes, panels):
        part = series.filter((pl.col("definition") == definition) & (pl.col("axis") == axis)).sort("value")
        best = (part.group_by(label).agg(pl.col("geomean_speedup").log().mean().alias("g"))
                .sort(["g", label], descending=[True, False]))
        drawn = best.head(MAX_LINES)[label].to_list()
        for name in drawn:
            line = part.filter(pl.col(label) == name)
            ax.plot(line["value"].to_list(), line["geomean_speedup"].to_list(), marker="o",
                    label=_short(str(name), definition))
        if best.height > len(drawn):
            ax.text(0.98, 0.04, f"{best.height - len(drawn)} slower not shown", transform=ax.transAxes, ha="right",
                    fontsize=8, color="#555")
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
        values = part["value"]
        if values.min() > 0 and values.max() / values.min() >= 16:
            ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        speedups = part["geomean_speedup"]
        ax.set_ylim(min(speedups.min(), 1.0) / 1.6, max(speedups.max(), 1.0) * 1.6)
        _log_ticks(ax, "y", "×")
        ax.set_title(definition, fontsize=10)
        ax.set_xlabel(axis)
        ax.set_ylabel("speedup (geomean, log)")
        ax.grid(True, which="both", alpha=0.3)
        _legend_below(ax, len(drawn))
    fig.suptitle("Speedup over the reference along each var axis (PASSED only; 1 = reference speed)"
                 + _panels_note(len(axes), len(panels)))
    return fig


def failure_figure(taxonomy: pl.DataFrame, reasons: pl.DataFrame, by: tuple[str, ...] = ("author", "language"),
                   top_reasons: int = 12) -> Figure:
    """Left: share of each status category per group (stacked bars). Right: the commonest failure reasons."""
    if taxonomy.is_empty():
        return _empty("no evaluations")
    fig = _figure((14, max(3.5, 0.55 * taxonomy.height + 2.4)))
    left, right = fig.subplots(1, 2)
    labels = [" / ".join(str(v) for v in row) for row in taxonomy.select(*by).rows()]
    start = [0.0] * taxonomy.height
    for cat in ["passed", *CATEGORIES.values(), "other"]:
        shares = taxonomy[f"{cat}_share"].to_list()
        if not any(shares):
            continue
        left.barh(labels, shares, left=start, color=CATEGORY_COLORS[cat], label=cat)
        start = [s + v for s, v in zip(start, shares)]
    left.set_xlim(0, 1)
    left.invert_yaxis()
    left.set_xlabel("share of evaluations")
    left.set_title("Outcome by " + " / ".join(by))
    left.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=4, frameon=False)
    if reasons.is_empty():
        right.axis("off")
        right.text(0.5, 0.5, "no failures", ha="center", va="center")
    else:
        top = (reasons.group_by("category", "reason").agg(pl.col("count").sum())
               .sort(["count", "reason"], descending=[True, False]).head(top_reasons))
        right.barh([f"{c}: {r}" for c, r in top.select("category", "reason").rows()], top["count"].to_list(),
                   color=[CATEGORY_COLORS.get(c, "#9e9e9e") for c in top["category"].to_list()])
        right.invert_yaxis()
        right.set_xlabel("failed evaluations")
        right.set_title("Commonest failure reasons (category: reason)")
    return fig


def ranking_figure(ranking: pl.DataFrame, p: float) -> Figure:
    """Authors' scores with their bootstrap intervals; tied authors share a colour band."""
    if ranking.is_empty():
        return _empty("no authors")
    fig = _figure((8, max(2.5, 0.5 * ranking.height + 1.2)))
    ax = fig.subplots()
    names = [f"#{r} {a}" for r, a in ranking.select("rank", "author").rows()]
    scores = ranking["score"].to_list()
    err = [[s - lo for s, lo in zip(scores, ranking["ci_low"].to_list())],
           [hi - s for s, hi in zip(scores, ranking["ci_high"].to_list())]]
    ax.errorbar(scores, names, xerr=err, fmt="o", capsize=4, color="#1565c0")
    ax.invert_yaxis()
    ax.set_xlim(-0.03, 1.03)
    ax.set_xlabel(f"fast_{p:g} averaged over definitions (95% bootstrap interval)")
    ax.set_title("Authors ranked; equal rank = difference within noise")
    ax.grid(True, axis="x", alpha=0.3)
    return fig


def save(fig: Figure, path: Path) -> Path:
    """Write a figure as PNG."""
    fig.savefig(path, dpi=110)
    return path


def png_bytes(fig: Figure) -> bytes:
    """A figure as PNG bytes (notebooks show them with IPython.display.Image)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()


def evolve_rounds_figure(rounds: pl.DataFrame) -> Figure:
    """The agent loop: best public speedup so far against the round, one line per (run, definition)."""
    drawn = rounds.filter(pl.col("best_so_far").is_not_null())
    if drawn.is_empty():
        return _empty("no loop candidate passed every public workload yet")
    fig = _figure((7.5, 4.6))
    ax = fig.subplots()
    keys = drawn.select("run_id", "definition").unique().sort("run_id", "definition").rows()
    for run_id, definition in keys[:MAX_LINES]:
        line = rounds.filter((pl.col("run_id") == run_id) & (pl.col("definition") == definition)).sort("round")
        ax.step(line["round"].to_list(), line["best_so_far"].to_list(), where="post", marker="o", markersize=3,
                linewidth=1.8, label=f"{definition} ({run_id})" if len({k[0] for k in keys}) > 1 else definition)
    ax.set_yscale("log")
    _log_ticks(ax, "y", "×")
    ax.set_xlabel("round")
    ax.set_ylabel("best speedup so far (public workloads)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    fig.suptitle("Agent loop: best speedup per round" + (f" (first {MAX_LINES} of {len(keys)})" if len(keys) > MAX_LINES else ""))
    return fig
