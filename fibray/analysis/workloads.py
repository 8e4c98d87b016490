"""Per-workload views: the best solution of each workload, and speedup along each var axis.

Axis values come from the `axes` JSON column; only the distinct axes strings (one per
workload) are parsed in Python, never the rows.
"""

from __future__ import annotations

import json
from typing import Sequence

import polars as pl

from fibray.analysis.frame import PASSED

WORKLOAD_KEYS = ("definition", "workload_uuid")


def best_per_workload(units: pl.LazyFrame) -> pl.DataFrame:
    """One row per workload: its fastest PASSED solution (ties: lower latency, then name).

    A workload that no solution passed is kept with nulls, since that gap is news too.
    """
    workloads = units.group_by(list(WORKLOAD_KEYS)).agg(
        pl.col("axes").first(), pl.col("solution").n_unique().alias("candidates"),
    )
    order = dict(by=["speedup", "latency_ms", "solution"], descending=[True, False, False])
    best = (
        units.filter((pl.col("status") == PASSED) & pl.col("speedup").is_not_null())
        .group_by(list(WORKLOAD_KEYS))
        .agg(
            *(pl.col(c).sort_by(**order).first() for c in ("solution", "author", "language", "speedup", "latency_ms",
                                                          "reference_latency_ms")),
            pl.len().alias("passed_solutions"),
        )
    )
    return (
        workloads.join(best, on=list(WORKLOAD_KEYS), how="left")
        .with_columns(pl.col("passed_solutions").fill_null(0))
        .select(*WORKLOAD_KEYS, "axes", "candidates", "passed_solutions", "solution", "author", "language",
                "speedup", "latency_ms", "reference_latency_ms")
        .sort(list(WORKLOAD_KEYS))
        .collect()
    )


def axis_values(units: pl.LazyFrame) -> pl.DataFrame:
    """(definition, axes) -> one row per numeric var axis: axis name and value as a float."""
    distinct = units.select("definition", "axes").unique().collect()
    rows = []
    for definition, axes in distinct.iter_rows():
        for axis, value in (json.loads(axes) if axes else {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                rows.append({"definition": definition, "axes": axes, "axis": axis, "value": float(value)})
    return pl.DataFrame(rows, schema={"definition": pl.String, "axes": pl.String, "axis": pl.String, "value": pl.Float64})


def speedup_by_axis(units: pl.LazyFrame, by: Sequence[str] = ("solution",)) -> pl.DataFrame:
    """Geomean speedup of PASSED evaluations at each value of each var axis, per definition and `by`.

    With several var axes, each axis gets its own series and the other axes are averaged over.
    """
    passed = units.filter((pl.col("status") == PASSED) & (pl.col("speedup") > 0))
    keys = ["definition", "axis", *by, "value"]
    return (
        passed.join(axis_values(units).lazy(), on=["definition", "axes"])
        .group_by(keys)
        .agg(pl.col("speedup").log().mean().exp().alias("geomean_speedup"), pl.len().alias("n"))
        .sort(keys)
        .collect()
    )
