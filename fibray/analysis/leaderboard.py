"""Leaderboards per definition: workloads passed / total, geomean speedup, fast_p.

fast_p (KernelBench) is the share of a definition's workloads on which a solution is
PASSED and more than p times faster than the reference; fast_0 is the correct rate.
The denominator is every workload of the definition in the selection, so a workload a
solution was never run on counts against it. Nothing here reads files eagerly.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import polars as pl

from fibray.analysis.frame import PASSED

DEFAULT_PS: tuple[float, ...] = (0.0, 1.0, 1.5, 2.0)
SOLUTION_KEYS = ("definition", "solution", "author", "language")


def fast_p_column(p: float) -> str:
    """Column name of fast_p for threshold p: fast_0, fast_1, fast_1.5, ..."""
    return f"fast_{p:g}"


def _fast(p: float) -> pl.Expr:
    """True for a unit that counts towards fast_p; p=0 is the correct rate even without a speedup."""
    passed = pl.col("status") == PASSED
    return passed if p == 0 else passed & (pl.col("speedup") > p)


def _totals(units: pl.LazyFrame) -> pl.LazyFrame:
    return units.group_by("definition").agg(pl.col("workload_uuid").n_unique().alias("total"))


def leaderboard(units: pl.LazyFrame, ps: Sequence[float] = DEFAULT_PS) -> pl.DataFrame:
    """One row per (definition, solution): passed, total, pass rate, geomean speedup, fast_p.

    `units` comes from `evaluations()`. Rows are sorted by definition, then best first
    (fast_1 if present, else the first p; then geomean speedup).
    """
    passed = pl.col("status") == PASSED
    log_speedup = pl.when(passed & (pl.col("speedup") > 0)).then(pl.col("speedup").log())
    # The definition's workload count rides along as a window, so the units are computed once.
    per_solution = units.with_columns(
        pl.col("workload_uuid").n_unique().over("definition").alias("total"),
    ).group_by(list(SOLUTION_KEYS)).agg(
        pl.col("total").first(),
        pl.col("workload_uuid").filter(passed).n_unique().alias("passed"),
        pl.len().alias("evaluated"),
        log_speedup.mean().exp().alias("geomean_speedup"),
        *(pl.col("workload_uuid").filter(_fast(p)).n_unique().alias(fast_p_column(p)) for p in ps),
    )
    rank_col = fast_p_column(1.0) if 1.0 in ps else fast_p_column(ps[0])
    return (
        per_solution.with_columns(
            (pl.col("passed") / pl.col("total")).alias("pass_rate"),
            *((pl.col(fast_p_column(p)) / pl.col("total")).alias(fast_p_column(p)) for p in ps),
        )
        .select(*SOLUTION_KEYS, "passed", "total", "evaluated", "pass_rate", "geomean_speedup",
                *(fast_p_column(p) for p in ps))
        .sort(["definition", rank_col, "geomean_speedup", "solution"],
              descending=[False, True, True, False], nulls_last=True)
        .collect()
    )


def p_grid(units: pl.LazyFrame, n: int = 80) -> list[float]:
    """Log-spaced thresholds spanning the passed speedups (at least 0.5 to 2.5), plus 0, 1, 1.5 and 2."""
    lo, hi = (units.filter((pl.col("status") == PASSED) & (pl.col("speedup") > 0))
              .select(pl.col("speedup").min().alias("lo"), pl.col("speedup").max().alias("hi")).collect().row(0))
    low = max(1e-4, min(0.5, (lo or 1.0) / 1.5))
    high = max(2.5, 1.25 * (hi or 0.0))
    step = (math.log(high) - math.log(low)) / (n - 1)
    return sorted({0.0, 1.0, 1.5, 2.0, *(math.exp(math.log(low) + i * step) for i in range(n))})


def fast_p_curve(units: pl.LazyFrame, ps: Iterable[float], by: Sequence[str] = ("definition", "solution")) -> pl.DataFrame:
    """fast_p for each p and each group of `by` (long format: *by, p, fast_p).

    Grouping by ("definition", "author") gives an author's best-of: a workload counts if
    any of the author's solutions for it is PASSED and faster than p.
    """
    ps = sorted(set(float(p) for p in ps))
    with_def = list(dict.fromkeys([*by, "definition"]))
    per_workload = (
        units.with_columns(pl.when(pl.col("status") == PASSED).then(pl.col("speedup").fill_null(0.0)).alias("_s"))
        .group_by([*with_def, "workload_uuid"])
        .agg(pl.col("_s").max(), (pl.col("status") == PASSED).any().alias("_passed"))
    )
    # The denominator: every workload of every definition the group was evaluated on.
    group_defs = units.select(with_def).unique()
    totals = group_defs.join(_totals(units), on="definition").group_by(list(by)).agg(pl.col("total").sum())
    wide = per_workload.group_by(list(by)).agg(
        *((pl.col("_passed") if p == 0 else pl.col("_passed") & (pl.col("_s") > p)).sum().alias(f"{i}")
          for i, p in enumerate(ps)),
    ).join(totals, on=list(by))
    long = wide.unpivot(index=[*by, "total"], variable_name="_i", value_name="_n").collect()
    return (
        long.with_columns(
            pl.col("_i").replace_strict({str(i): p for i, p in enumerate(ps)}, return_dtype=pl.Float64).alias("p"),
            (pl.col("_n") / pl.col("total")).alias("fast_p"),
        )
        .select(*by, "p", "fast_p")
        .sort([*by, "p"])
    )
