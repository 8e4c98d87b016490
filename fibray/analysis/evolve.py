"""The agent loop's rows (fibray.evolve): best speedup per round and the public -> hidden gap per definition.

A candidate's speedup is the geomean over its public workloads when it PASSED every one of them;
rows without a `round` (sweeps) are ignored. Reads only, like every analysis.
"""

from __future__ import annotations

import polars as pl

__all__ = ["evolve_gap", "evolve_rounds", "has_loop_rows"]

_KEYS = ("run_id", "definition")


def has_loop_rows(units: pl.LazyFrame) -> bool:
    """Whether any row came from the agent loop."""
    return units.filter(pl.col("round").is_not_null()).select(pl.len()).collect().item() > 0


def _candidates(units: pl.LazyFrame, split: str) -> pl.LazyFrame:
    """One row per (run, definition, solution) on one split: round, passed-all, geomean speedup."""
    rows = units.filter(pl.col("round").is_not_null() & (pl.col("split").fill_null("public") == split))
    return rows.group_by([*_KEYS, "solution"]).agg(
        pl.col("round").min(),
        (pl.col("status") == "PASSED").all().alias("passed"),
        pl.len().alias("workloads"),
        pl.col("speedup").log().mean().exp().alias("speedup"),
    ).with_columns(pl.when(pl.col("passed")).then(pl.col("speedup")).otherwise(None).alias("speedup"))


def evolve_rounds(units: pl.LazyFrame) -> pl.DataFrame:
    """Per run, definition and round: candidates, how many passed, the round's best and the best so far."""
    per_round = _candidates(units, "public").group_by([*_KEYS, "round"]).agg(
        pl.len().alias("candidates"), pl.col("passed").sum().alias("passed"),
        pl.col("speedup").max().alias("round_best"),
    ).sort([*_KEYS, "round"])
    return per_round.with_columns(
        pl.col("round_best").fill_null(0.0).cum_max().over(list(_KEYS)).alias("best_so_far"),
    ).with_columns(pl.when(pl.col("best_so_far") > 0).then(pl.col("best_so_far")).otherwise(None)
                   .alias("best_so_far")).collect()


def evolve_gap(units: pl.LazyFrame) -> pl.DataFrame:
    """Per run and definition: the best public candidate, its public and hidden speedup, and the gap
    (hidden / public - 1; a candidate tuned to the public shapes shows a negative gap)."""
    public = _candidates(units, "public").filter(pl.col("speedup").is_not_null())
    best = public.sort("speedup", descending=True).group_by(list(_KEYS)).first()
    hidden = _candidates(units, "hidden").select(*_KEYS, "solution", pl.col("passed").alias("hidden_passed"),
                                                 pl.col("workloads").alias("hidden_workloads"),
                                                 pl.col("speedup").alias("hidden_speedup"))
    return best.join(hidden, on=[*_KEYS, "solution"], how="left").select(
        *_KEYS, pl.col("solution").alias("best"), "round", pl.col("speedup").alias("public_speedup"),
        "hidden_workloads", "hidden_passed", "hidden_speedup",
        (pl.col("hidden_speedup") / pl.col("speedup") - 1.0).alias("gap"),
    ).sort(list(_KEYS)).collect()
