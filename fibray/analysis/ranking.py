"""Ranking of authors (agents) across definitions, with bootstrap confidence intervals.

An author's score is fast_p averaged over the definitions it entered (each definition
weighs the same); within a definition it is the mean, over workloads, of the share of the
author's solutions that are PASSED and faster than p. Workloads are resampled within each
definition, the same draw for every author, so differences are paired. Two authors are
tied unless the interval of their score difference excludes zero; it never hides a tie.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from fibray.analysis.frame import PASSED

# Keep one block of bootstrap counts under this many cells (memory, not speed).
_MAX_BLOCK_CELLS = 10_000_000


def _unit_values(units: pl.LazyFrame, p: float) -> pl.DataFrame:
    """(definition, workload_uuid, author) -> share of the author's solutions fast at p there."""
    fast = pl.col("status") == PASSED
    if p != 0:
        fast = fast & (pl.col("speedup") > p)
    return (
        units.group_by("definition", "workload_uuid", "author")
        .agg(fast.mean().alias("value"), pl.col("solution").n_unique().alias("solutions"))
        .collect()
    )


def _resample_counts(rng: np.random.Generator, n_boot: int, n: int) -> np.ndarray:
    """How often each of n items is drawn, for n_boot resamples of size n (n_boot x n)."""
    out = np.empty((n_boot, n), dtype=np.float64)
    block = max(1, _MAX_BLOCK_CELLS // max(n, 1))
    for start in range(0, n_boot, block):
        b = min(block, n_boot - start)
        idx = rng.integers(0, n, size=(b, n)) + (np.arange(b)[:, None] * n)
        out[start:start + b] = np.bincount(idx.ravel(), minlength=b * n).reshape(b, n)
    return out


def rank_authors(
    units: pl.LazyFrame,
    p: float = 1.0,
    n_boot: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> pl.DataFrame:
    """One row per author: rank, score (fast_p), its interval, and the authors it is tied with.

    rank is 1 + the number of authors significantly better; tied authors share a rank.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence: must be in (0, 1), got {confidence}")
    values = _unit_values(units, p)
    authors = sorted(values["author"].unique().to_list())
    columns = ["rank", "author", "score", "ci_low", "ci_high", "definitions", "workloads", "solutions", "tied_with"]
    if not authors:
        return pl.DataFrame(schema={c: pl.Int64 if c in ("rank", "definitions", "workloads", "solutions")
                                    else pl.Float64 if c in ("score", "ci_low", "ci_high")
                                    else pl.List(pl.String) if c == "tied_with" else pl.String for c in columns})
    col = {a: i for i, a in enumerate(authors)}
    rng = np.random.default_rng(seed)
    boot_sum = np.zeros((n_boot, len(authors)))
    point_sum = np.zeros(len(authors))
    covered = np.zeros(len(authors))
    for (definition,), part in values.sort("definition", "workload_uuid").group_by("definition", maintain_order=True):
        workloads = part["workload_uuid"].unique(maintain_order=True).to_list()
        row = {w: i for i, w in enumerate(workloads)}
        present = sorted({col[a] for a in part["author"].to_list()})
        # An author that entered the definition but has no row for a workload scores 0 there.
        matrix = np.zeros((len(workloads), len(authors)))
        for w, a, v in part.select("workload_uuid", "author", "value").iter_rows():
            matrix[row[w], col[a]] = v
        counts = _resample_counts(rng, n_boot, len(workloads))
        boot = counts @ matrix / len(workloads)
        boot_sum[:, present] += boot[:, present]
        point_sum[present] += matrix[:, present].mean(axis=0)
        covered[present] += 1
    boot_scores = boot_sum / covered
    scores = point_sum / covered
    alpha = (1 - confidence) / 2
    low, high = np.quantile(boot_scores, [alpha, 1 - alpha], axis=0)
    # better[i, j]: author i is significantly better than author j (paired difference > 0).
    diff_low = np.quantile(boot_scores[:, :, None] - boot_scores[:, None, :], alpha, axis=0)
    better = diff_low > 0
    per_author = values.group_by("author").agg(
        pl.col("definition").n_unique().alias("definitions"),
        pl.struct("definition", "workload_uuid").n_unique().alias("workloads"),
    )
    rows = []
    for a, i in col.items():
        tied = [b for b, j in col.items() if j != i and not better[i, j] and not better[j, i]]
        rows.append({"rank": 1 + int(better[:, i].sum()), "author": a, "score": float(scores[i]),
                     "ci_low": float(low[i]), "ci_high": float(high[i]), "tied_with": tied})
    return (
        pl.DataFrame(rows, schema_overrides={"tied_with": pl.List(pl.String)})
        .join(per_author, on="author")
        .join(_solutions_per_author(units), on="author")
        .select(columns)
        .sort(["rank", "score", "author"], descending=[False, True, False])
    )


def _solutions_per_author(units: pl.LazyFrame) -> pl.DataFrame:
    return units.group_by("author").agg(pl.struct("definition", "solution").n_unique().alias("solutions")).collect()
