"""Correctness checks: structural (shape, dtype, finiteness) and per-kind numerical checkers."""

from fibray.check import elementwise as _elementwise  # noqa: F401  (registers checkers)
from fibray.check.base import CheckResult, Tolerance, checker_for, error_stats, judge_calls, register_checker, structural
from fibray.check.sampling import Draws, collect_draws, draw_plan, wants_draws  # registers "sampling"

__all__ = [
    "CheckResult", "Tolerance", "checker_for", "error_stats", "judge_calls", "register_checker", "structural",
    "Draws", "collect_draws", "draw_plan", "wants_draws",
]
