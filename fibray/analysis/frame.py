"""The rows every analysis starts from: one evaluation per (definition, solution, workload).

Opens a store lazily, keeps the chosen sweeps, and resolves duplicates (the row its driver
published last wins: never a timestamp a row carries). It never reads more columns than the
caller's query asks for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional, Union

import polars as pl

from fibray.store import TraceStore, scan

PASSED = "PASSED"

# Failure status -> short category name, in the order tables and plots show them.
CATEGORIES: dict[str, str] = {
    "COMPILE_ERROR": "compile",
    "RUNTIME_ERROR": "runtime",
    "INCORRECT_NUMERICAL": "numerical",
    "INCORRECT_SHAPE": "shape",
    "INCORRECT_DTYPE": "dtype",
    "TIMEOUT": "timeout",
}

# What identifies one evaluation unit: a solution on a workload of a definition.
UNIT_KEYS = ("definition", "author", "solution", "workload_uuid")

Source = Union[str, Path, TraceStore, pl.LazyFrame, pl.DataFrame]


class AnalysisError(ValueError):
    """The store or the selection cannot be analysed (missing store, unknown sweep)."""


def open_store(source: Source) -> pl.LazyFrame:
    """Every row of a store as a LazyFrame; a path must be an existing store with rows."""
    if isinstance(source, pl.LazyFrame):
        return source
    if isinstance(source, pl.DataFrame):
        return source.lazy()
    root = source.root if isinstance(source, TraceStore) else Path(source)
    if not root.is_dir():
        raise AnalysisError(f"store: {root} does not exist or is not a directory")
    if not any(root.glob("definition=*/sweep=*/*.parquet")):
        raise AnalysisError(f"store: {root} holds no trace files (expected definition=*/sweep=*/part-*.parquet)")
    return scan(root)


def sweeps(source: Source) -> pl.DataFrame:
    """Sweeps of a store with their row counts and last finish time, latest first."""
    return (
        open_store(source)
        .group_by("sweep")
        .agg(pl.len().alias("rows"), pl.col("definition").n_unique().alias("definitions"),
             pl.col("finished_at").max().alias("last_finished_at"))
        .sort("last_finished_at", "sweep", descending=True, nulls_last=True)
        .collect()
    )


def _as_list(value: Optional[Union[str, Iterable[str]]]) -> Optional[list[str]]:
    if value is None:
        return None
    return [value] if isinstance(value, str) else list(value)


LIMITED = pl.col("environment_limited").fill_null(False)
"""True for a row that could not run where it ran (no GPU, Triton too slow interpreted): not the author's verdict."""


def evaluations(
    source: Source,
    sweeps: Optional[Union[str, Iterable[str]]] = None,
    definitions: Optional[Union[str, Iterable[str]]] = None,
    environment_limited: Optional[bool] = False,
) -> pl.LazyFrame:
    """Rows of the chosen sweeps (all if None), one per unit; a repeated unit keeps its latest row.

    Pooling several sweeps is allowed (a sweep split into parts); a job recorded twice, or
    a solution re-run on the same workload, then counts once, as its latest verdict.
    environment_limited: False (default) leaves out rows that could not run here, so no
    leaderboard, ranking or taxonomy charges them to their authors; True keeps only those;
    None keeps every row.
    """
    lf = open_store(source)
    if environment_limited is not None and "environment_limited" in lf.collect_schema().names():
        lf = lf.filter(LIMITED if environment_limited else ~LIMITED)
    wanted = _as_list(sweeps)
    if wanted is not None:
        lf = lf.filter(pl.col("sweep").is_in(wanted))
    defs = _as_list(definitions)
    if defs is not None:
        lf = lf.filter(pl.col("definition").is_in(defs))
    return latest_per_unit(lf)


def latest_per_unit(lf: pl.LazyFrame) -> pl.LazyFrame:
    """Keep the last row of each unit in `lf`'s order, which for a store (`scan`) is the order its
    drivers published the rows in (their signed manifests'): no field of a row, which a forger
    would choose (a `finished_at` in 2099), decides which verdict is the latest.

    Picking row numbers in a group_by and semi-joining them back is several times faster
    than sort + unique(keep="last") on a million rows, and reads only the columns asked for.
    """
    numbered = lf.with_row_index("_row")
    latest = numbered.group_by(list(UNIT_KEYS)).agg(pl.col("_row").max())
    return numbered.join(latest, on="_row", how="semi").drop("_row")


def check_sweeps(source: Source, wanted: Iterable[str]) -> None:
    """Raise AnalysisError naming any sweep the store does not hold."""
    have = set(sweeps(source)["sweep"].to_list())
    missing = [s for s in wanted if s not in have]
    if missing:
        raise AnalysisError(f"sweep: {', '.join(map(repr, missing))} not in store (it has: {', '.join(sorted(have)) or 'none'})")
