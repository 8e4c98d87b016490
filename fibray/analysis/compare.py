"""Comparison of two sweeps: regressions, improvements and status flips per evaluation unit.

Units (definition, author, solution, workload) are matched by name across the sweeps.
Where both sweeps passed, the change is the ratio of speedups (each against the
reference timed in its own sweep, so hardware or timer drift cancels); a change within
`tolerance` is noise and reported as unchanged.
"""

from __future__ import annotations

from typing import Iterable, Optional, Union

import polars as pl

from fibray.analysis.frame import PASSED, UNIT_KEYS, Source, check_sweeps, evaluations, open_store

# Every value of the `change` column, worst first.
CHANGES = ("broken", "regression", "status_changed", "dropped", "added", "unchanged", "improvement", "fixed")

_SIDE_COLUMNS = ("status", "reason", "speedup", "latency_ms", "solution_hash")


def compare_sweeps(
    source: Source,
    baseline: str,
    candidate: str,
    tolerance: float = 0.05,
    definitions: Optional[Union[str, Iterable[str]]] = None,
) -> pl.DataFrame:
    """One row per unit in either sweep: both verdicts, the speedup ratio and the `change`.

    change: broken (PASSED -> failed), fixed (failed -> PASSED), status_changed (one
    failure -> another), regression / improvement (both PASSED, speedup ratio beyond
    1 -/+ tolerance), unchanged, added (only in candidate), dropped (only in baseline).
    """
    if tolerance < 0:
        raise ValueError(f"tolerance: must be >= 0, got {tolerance}")
    lf = open_store(source)
    check_sweeps(lf, [baseline, candidate])

    def side(sweep: str, suffix: str) -> pl.LazyFrame:
        return evaluations(lf, sweep, definitions).select(
            *UNIT_KEYS, "axes", "language", *(pl.col(c).alias(f"{c}_{suffix}") for c in _SIDE_COLUMNS),
        ).with_columns(pl.lit(True).alias(f"_in_{suffix}"))

    base, cand = side(baseline, "base"), side(candidate, "new")
    joined = base.join(cand, on=list(UNIT_KEYS), how="full", coalesce=True, suffix="_right")
    passed_b, passed_n = pl.col("status_base") == PASSED, pl.col("status_new") == PASSED
    ratio = pl.col("speedup_new") / pl.col("speedup_base")
    change = (
        pl.when(pl.col("_in_base").is_null()).then(pl.lit("added"))
        .when(pl.col("_in_new").is_null()).then(pl.lit("dropped"))
        .when(passed_b & ~passed_n).then(pl.lit("broken"))
        .when(~passed_b & passed_n).then(pl.lit("fixed"))
        .when(~passed_b & (pl.col("status_base") != pl.col("status_new"))).then(pl.lit("status_changed"))
        .when(passed_b & (pl.col("ratio") < 1 / (1 + tolerance))).then(pl.lit("regression"))
        .when(passed_b & (pl.col("ratio") > 1 + tolerance)).then(pl.lit("improvement"))
        .otherwise(pl.lit("unchanged"))
    )
    return (
        joined.with_columns(
            pl.coalesce("axes", "axes_right").alias("axes"),
            pl.coalesce("language", "language_right").alias("language"),
            pl.when(passed_b & passed_n).then(ratio).alias("ratio"),
        )
        .with_columns(
            change.alias("change"),
            (pl.col("status_base") != pl.col("status_new")).fill_null(False).alias("status_flip"),
            (pl.col("solution_hash_base") != pl.col("solution_hash_new")).fill_null(False).alias("solution_changed"),
        )
        .select(*UNIT_KEYS, "language", "axes", "change", "status_flip", "ratio",
                "status_base", "status_new", "reason_base", "reason_new", "speedup_base", "speedup_new",
                "latency_ms_base", "latency_ms_new", "solution_changed")
        .with_columns(pl.col("change").cast(pl.Enum(CHANGES)))
        .sort(["change", "definition", "solution", "workload_uuid"])
        .collect()
    )


def comparison_summary(comparison: pl.DataFrame) -> pl.DataFrame:
    """Per definition: how many units of each change kind, and the geomean speedup ratio of units passed in both."""
    return (
        comparison.group_by("definition")
        .agg(
            pl.len().alias("units"),
            *((pl.col("change") == c).sum().alias(c) for c in CHANGES),
            pl.col("ratio").filter(pl.col("ratio") > 0).log().mean().exp().alias("geomean_ratio"),
        )
        .sort("definition")
    )
