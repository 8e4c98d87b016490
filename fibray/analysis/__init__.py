"""Polars analysis over the trace store: leaderboards, fast_p, author ranking, failures, sweep comparison.

Everything starts from `evaluations(store, sweeps=...)`, a LazyFrame with one row per
(definition, author, solution, workload); the functions here only read, never write.
"""

from fibray.analysis.compare import CHANGES, compare_sweeps, comparison_summary
from fibray.analysis.environment import cpu_timed, describe_timing, limited_summary, timing_modes
from fibray.analysis.evolve import evolve_gap, evolve_rounds, has_loop_rows
from fibray.analysis.failures import category_expr, failure_reasons, failure_taxonomy
from fibray.analysis.frame import CATEGORIES, AnalysisError, check_sweeps, evaluations, open_store, sweeps
from fibray.analysis.leaderboard import DEFAULT_PS, fast_p_column, fast_p_curve, leaderboard, p_grid
from fibray.analysis.ranking import rank_authors
from fibray.analysis.workloads import axis_values, best_per_workload, speedup_by_axis

__all__ = [
    "CATEGORIES", "CHANGES", "DEFAULT_PS", "AnalysisError", "axis_values", "best_per_workload", "category_expr",
    "check_sweeps", "compare_sweeps", "cpu_timed", "describe_timing", "limited_summary", "timing_modes", "comparison_summary", "evaluations", "evolve_gap", "evolve_rounds", "failure_reasons", "failure_taxonomy",
    "fast_p_column", "fast_p_curve", "has_loop_rows", "leaderboard", "open_store", "p_grid", "rank_authors", "speedup_by_axis",
    "sweeps",
]
