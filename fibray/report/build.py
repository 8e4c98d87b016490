"""Build the report of one sweep: the analysis tables, PNG plots and one self-contained HTML file.

Reads the store only through `fibray.analysis`; writes only under the output folder.
"""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import polars as pl

from fibray.analysis import (
    AnalysisError,
    best_per_workload,
    check_sweeps,
    compare_sweeps,
    comparison_summary,
    cpu_timed,
    describe_timing,
    evaluations,
    evolve_gap,
    evolve_rounds,
    failure_reasons,
    failure_taxonomy,
    has_loop_rows,
    fast_p_curve,
    leaderboard,
    limited_summary,
    open_store,
    p_grid,
    rank_authors,
    speedup_by_axis,
    sweeps,
)
from fibray.report import plots
from fibray.report.tables import to_html, to_text

RANKING_P = 1.0
_CSS = """body{font-family:system-ui,sans-serif;margin:2em;color:#222}h1{margin-bottom:0}
.meta{color:#666;margin-bottom:1.5em}table{border-collapse:collapse;font-size:12px;margin:0.5em 0 1.5em}
th,td{border:1px solid #ddd;padding:3px 8px}th{background:#f3f3f3;text-align:left}td.num{text-align:right;
font-variant-numeric:tabular-nums}img{max-width:100%;border:1px solid #eee;margin:0.5em 0}p.note{color:#555}"""


@dataclass
class Section:
    """One part of the report: a title, a note saying how to read it, tables and plots."""

    title: str
    note: str
    tables: list[tuple[str, pl.DataFrame]] = field(default_factory=list)
    pngs: list[Path] = field(default_factory=list)


@dataclass
class Report:
    """What `build_report` produced."""

    store: Path
    sweep: str
    baseline: Optional[str]
    sections: list[Section]
    html: Path
    notes: list[str] = field(default_factory=list)

    @property
    def pngs(self) -> list[Path]:
        return [p for s in self.sections for p in s.pngs]

    def text(self) -> str:
        """Every table as aligned text, for the terminal."""
        out = [f"fibray report: store {self.store}, sweep {self.sweep!r}"
               + (f" vs baseline {self.baseline!r}" if self.baseline else ""), *self.notes]
        for s in self.sections:
            if not s.tables:
                out += ["", f"## {s.title}", s.note]
            for caption, df in s.tables:
                out += ["", f"## {s.title}: {caption}" if caption else f"## {s.title}", to_text(df)]
        out += ["", "files:", *(f"  {p}" for p in [*self.pngs, self.html])]
        return "\n".join(out)


def choose_sweep(store: Path, sweep: Optional[str]) -> tuple[str, list[str]]:
    """The sweep to report on (the given one, else the latest finished) and notes about the choice."""
    known = sweeps(store)
    if sweep is not None:
        check_sweeps(store, [sweep])
        return sweep, []
    names = known["sweep"].to_list()
    notes = [] if len(names) == 1 else [f"note: store has sweeps {', '.join(names)}; reporting the latest, {names[0]!r} (use --sweep)"]
    return names[0], notes


CPU_HIDDEN = ("Timed by wall clock on a CPU (Triton interpreted): speedups are not meaningful, so they are hidden "
              "here (python -m fibray.report --show-cpu-speedups shows them).")


def _leaderboard_sections(units: pl.LazyFrame, out: Path, seed: int, hide_speedups: bool = False) -> list[Section]:
    board = leaderboard(units)
    if hide_speedups:
        board = board.drop("geomean_speedup", *(c for c in board.columns if c.startswith("fast_") and c != "fast_0"))
        p = 0.0
    else:
        p = RANKING_P
    ranking = rank_authors(units, p=p, seed=seed)
    ranking_note = (f"Score = fast_{p:g} averaged over definitions (each author's solutions averaged per workload); 95% "
                    "bootstrap intervals from resampling workloads within definitions. Authors whose paired difference "
                    "is within noise share a rank (tied_with).")
    if hide_speedups:
        return [
            Section("Leaderboard", "Per definition: workloads passed / total and fast_0 (the correct rate). " + CPU_HIDDEN,
                    [("", board)]),
            Section("Author ranking", "Ranked by correctness (fast_0), not speed. " + ranking_note + " " + CPU_HIDDEN,
                    [("", ranking)], [plots.save(plots.ranking_figure(ranking, p), out / "ranking.png")]),
            Section("Speedup by workload", CPU_HIDDEN),
        ]
    curve = fast_p_curve(units, p_grid(units))
    best = best_per_workload(units)
    by_axis = speedup_by_axis(units)
    return [
        Section("Leaderboard", "Per definition: workloads passed / total, geomean speedup over PASSED workloads, and "
                "fast_p = share of the definition's workloads PASSED and more than p× faster than the reference "
                "(fast_0 = correct rate).",
                [("", board)], [plots.save(plots.fast_p_figure(curve), out / "fast_p.png")]),
        Section("Author ranking", ranking_note, [("", ranking)], [plots.save(plots.ranking_figure(ranking, p), out / "ranking.png")]),
        Section("Speedup by workload", "The fastest PASSED solution of each workload (none: no solution passed), "
                "and geomean speedup along each var axis.",
                [("best solution per workload", best.drop("workload_uuid"))],
                [plots.save(plots.speedup_by_axis_figure(by_axis), out / "speedup_by_axis.png")]),
    ]


def _limited_section(limited: pl.LazyFrame) -> Section:
    return Section("Could not run here", "Evaluations this machine could not judge (a CUDA candidate without a GPU: "
                   "device_required; a Triton kernel slower than the run deadline under the CPU interpreter: "
                   "run_timeout). Their status is recorded as it came, but they are left out of every table above: "
                   "no leaderboard, ranking or failure count charges them to their authors.",
                   [("", limited_summary(limited))])


def _failure_section(units: pl.LazyFrame, out: Path) -> Section:
    taxonomy = failure_taxonomy(units)
    reasons = failure_reasons(units)
    counts = taxonomy.select([c for c in taxonomy.columns if not c.endswith("_share")])
    return Section("Failure taxonomy", "Evaluations by outcome category per author and language, then each "
                   "failure reason with its share of the group's evaluations.",
                   [("by category", counts), ("by reason", reasons)],
                   [plots.save(plots.failure_figure(taxonomy, reasons), out / "failures.png")])


def _evolve_section(units: pl.LazyFrame, out: Path, cpu: bool) -> Section:
    rounds = evolve_rounds(units)
    tables = [(f"{definition} ({run_id})", part.drop("run_id", "definition"))
              for (run_id, definition), part in rounds.group_by(["run_id", "definition"], maintain_order=True)]
    return Section("Agent loop", "Rows recorded by `python -m fibray.evolve`: per definition and round, the candidates, "
                   "how many passed every public workload, the round's best and the best so far (geomean speedup over "
                   "public workloads); then the best candidate scored on the hidden workloads it never saw "
                   "(gap = hidden / public - 1)." + (" Timed by wall clock on a CPU: the loop's own objective here, "
                                                     "not a measure of the kernels." if cpu else ""),
                   [*tables, ("public -> hidden", evolve_gap(units))],
                   [plots.save(plots.evolve_rounds_figure(rounds), out / "evolve_rounds.png")])


def _comparison_section(store: Path, baseline: str, sweep: str, limit: int = 50) -> Section:
    cmp = compare_sweeps(store, baseline, sweep)
    changed = cmp.filter(pl.col("change") != "unchanged").select(
        "definition", "solution", "axes", "change", "ratio", "status_base", "status_new", "speedup_base", "speedup_new")
    return Section(f"Comparison with {baseline!r}", "Units matched by (definition, author, solution, workload). "
                   "regression / improvement: both PASSED and the speedup ratio moved by more than 5%; "
                   "broken / fixed / status_changed: the status flipped." + (
                       f" Showing the first {limit} of {changed.height} changed units." if changed.height > limit else ""),
                   [("summary", comparison_summary(cmp)), ("changed units", changed.head(limit))])


def _html(report_title: str, meta: list[str], sections: list[Section]) -> str:
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(report_title)}</title>"
             f"<style>{_CSS}</style></head><body><h1>{html.escape(report_title)}</h1>",
             "<div class='meta'>" + "<br>".join(html.escape(m) for m in meta) + "</div>"]
    for s in sections:
        parts.append(f"<h2>{html.escape(s.title)}</h2><p class='note'>{html.escape(s.note)}</p>")
        for png in s.pngs:
            data = base64.b64encode(png.read_bytes()).decode()
            parts.append(f"<img alt='{html.escape(png.stem)}' src='data:image/png;base64,{data}'>")
        for caption, df in s.tables:
            if caption:
                parts.append(f"<h3>{html.escape(caption)}</h3>")
            parts.append(to_html(df))
    parts.append("</body></html>")
    return "\n".join(parts)


def build_report(store: str | Path, out: str | Path, sweep: Optional[str] = None,
                 baseline: Optional[str] = None, seed: int = 0, show_cpu_speedups: bool = False) -> Report:
    """Analyse one sweep (and compare it with a baseline sweep), write PNGs and report.html under `out`.

    Speedups timed on a CPU are hidden unless `show_cpu_speedups`; environment-limited rows are
    left out of every table and listed in their own section.
    """
    store, out = Path(store), Path(out)
    open_store(store)  # a missing or empty store fails here, before anything is written
    sweep, notes = choose_sweep(store, sweep)
    if baseline is not None:
        if baseline == sweep:
            raise AnalysisError(f"baseline-sweep: must differ from the sweep ({sweep!r})")
        check_sweeps(store, [baseline])
    out.mkdir(parents=True, exist_ok=True)
    units = evaluations(store, sweep).collect().lazy()  # one read of the store; every query reuses it
    cpu = cpu_timed(units)
    notes = [*notes, describe_timing(units)]
    if cpu:
        notes.append("note: speedups were timed by wall clock on a CPU: not meaningful"
                     + ("" if show_cpu_speedups else "; hidden (--show-cpu-speedups to show)"))
    sections = [*_leaderboard_sections(units, out, seed, hide_speedups=cpu and not show_cpu_speedups),
                _failure_section(units, out)]
    limited = evaluations(store, sweep, environment_limited=True).collect().lazy()
    if limited.select(pl.len()).collect().item():
        sections.append(_limited_section(limited))
    if has_loop_rows(units):
        sections.append(_evolve_section(units, out, cpu))
    if baseline is not None:
        sections.append(_comparison_section(store, baseline, sweep))
    n = units.select(pl.len()).collect().item()
    meta = [f"store: {store.resolve()}", f"sweep: {sweep}" + (f" (baseline: {baseline})" if baseline else ""),
            f"evaluations: {n}", f"generated: {datetime.now(timezone.utc).isoformat(timespec='seconds')}", *notes]
    page = out / "report.html"
    page.write_text(_html(f"fibray report: {sweep}", meta, sections), encoding="utf-8")
    return Report(store, sweep, baseline, sections, page, notes)
