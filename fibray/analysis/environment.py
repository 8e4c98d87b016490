"""Where and how a sweep's results were measured: the timing mode, and what could not run there.

Speedups timed by wall clock on a CPU (Triton under its interpreter) say nothing about a GPU
kernel; rows marked environment_limited (no GPU, interpreter too slow) are no verdict on
their authors. These views let the report say so instead of ranking them.
"""

from __future__ import annotations

import polars as pl

from fibray.analysis.frame import PASSED
from fibray.store.columns import describe_timing_mode


def timing_modes(units: pl.LazyFrame) -> pl.DataFrame:
    """One row per (timing_mode, hardware) of PASSED units: how many, and whether Triton ran interpreted."""
    return (
        units.filter((pl.col("status") == PASSED) & pl.col("timing_mode").is_not_null())
        .group_by("timing_mode", "hardware")
        .agg(pl.len().alias("passed"), (pl.col("language") == "triton").any().alias("_triton"))
        .with_columns((pl.col("hardware").str.starts_with("cpu") & pl.col("_triton")).alias("triton_interpreted"))
        .drop("_triton")
        .sort("timing_mode", "hardware")
        .collect()
    )


def cpu_timed(units: pl.LazyFrame) -> bool:
    """True when every timed PASSED unit was timed on a CPU (wall clock): its speedups are not meaningful."""
    modes = timing_modes(units)
    return modes.height > 0 and all(hw.startswith("cpu") for hw in modes["hardware"].to_list())


def describe_timing(units: pl.LazyFrame) -> str:
    """'timing: wall clock on cpu-x86_64 (Triton interpreted)', one clause per (mode, hardware)."""
    parts = [f"{describe_timing_mode(mode)} on {hw}" + (" (Triton interpreted)" if interp else "")
             for mode, hw, _, interp in timing_modes(units).iter_rows()]
    return "timing: " + ("; ".join(parts) if parts else "nothing timed")


def limited_summary(limited: pl.LazyFrame) -> pl.DataFrame:
    """Environment-limited units per (definition, solution): how many, and the reasons."""
    return (
        limited.group_by("definition", "solution", "author", "language")
        .agg(pl.len().alias("evaluations"), pl.col("status").first(),
             pl.col("reason").unique().sort().str.join(", ").alias("reasons"))
        .sort("definition", "solution")
        .collect()
    )
