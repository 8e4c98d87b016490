"""Failure taxonomy: how evaluations fail, by author and language (or any grouping).

Statuses map to categories (compile, runtime, numerical, shape, dtype, timeout); each
failure's `reason` refines its category. Shares are of all evaluations in the group,
so a row's passed share and category shares add up to 1.
"""

from __future__ import annotations

from typing import Sequence

import polars as pl

from fibray.analysis.frame import CATEGORIES, PASSED

DEFAULT_BY = ("author", "language")


def category_expr() -> pl.Expr:
    """The category of a row's status: passed, compile, runtime, ..., or other."""
    return pl.col("status").replace_strict({PASSED: "passed", **CATEGORIES}, default="other", return_dtype=pl.String)


def failure_taxonomy(units: pl.LazyFrame, by: Sequence[str] = DEFAULT_BY) -> pl.DataFrame:
    """One row per group: evaluations, passed, then a count per failure category and its share."""
    categories = [*CATEGORIES.values(), "other"]
    cat = category_expr()
    counts = units.group_by(list(by)).agg(
        pl.len().alias("evaluations"),
        (pl.col("status") == PASSED).sum().alias("passed"),
        *((cat == c).sum().alias(c) for c in categories),
    )
    return (
        counts.with_columns(
            (pl.col("evaluations") - pl.col("passed")).alias("failed"),
            *((pl.col(c) / pl.col("evaluations")).alias(f"{c}_share") for c in ["passed", *categories]),
        )
        .select(*by, "evaluations", "passed", "failed", *categories,
                *(f"{c}_share" for c in ["passed", *categories]))
        .sort(list(by))
        .collect()
    )


def failure_reasons(units: pl.LazyFrame, by: Sequence[str] = DEFAULT_BY) -> pl.DataFrame:
    """Long format: one row per (group, category, status, reason) with its count and share of the group.

    A failure without a reason is listed with reason "unspecified".
    """
    group_total = units.group_by(list(by)).agg(pl.len().alias("_total"))
    return (
        units.filter(pl.col("status") != PASSED)
        .with_columns(category_expr().alias("category"), pl.col("reason").fill_null("unspecified"))
        .group_by(*by, "category", "status", "reason")
        .agg(pl.len().alias("count"))
        .join(group_total, on=list(by))
        .with_columns((pl.col("count") / pl.col("_total")).alias("share"))
        .drop("_total")
        .sort([*by, "count", "category", "reason"], descending=[*(False for _ in by), True, False, False])
        .collect()
    )
