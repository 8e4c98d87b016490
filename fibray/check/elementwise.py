"""Elementwise tolerance and matched-ratio checkers.

elementwise: every element satisfies |y-ref| <= atol + rtol*|ref|.
matched_ratio: at least `matched_ratio` of the elements do (for low-bit kernels).
"""

from __future__ import annotations

from typing import Optional

import torch

from fibray.check.base import (
    CheckResult, Status, Tolerance, error_stats, error_stats_many, register_checker, register_many, structural,
)
from fibray.schema.reasons import Reason


def _compare(outputs: list[torch.Tensor], refs: list[torch.Tensor], names: list[str], tol: Tolerance, required: float,
             stats: Optional[list[tuple[float, float, float]]] = None) -> CheckResult:
    """`stats`: error_stats of each output, already read (by _compare_many)."""
    result = CheckResult(extra={"matched_ratio": 1.0})
    for i, (out, ref, name) in enumerate(zip(outputs, refs, names)):
        bad = structural(out, ref, name) if stats is None else None
        if bad is not None:
            return bad
        max_abs, max_rel, ratio = error_stats(out, ref, tol) if stats is None else stats[i]
        one = CheckResult(max_abs=max_abs, max_rel=max_rel, extra={"matched_ratio": ratio})
        if ratio < required:
            one.status, one.reason = Status.INCORRECT_NUMERICAL, Reason.TOLERANCE_EXCEEDED
            one.message = (
                f"output {name!r}: {ratio:.6f} of elements within atol={tol.atol} rtol={tol.rtol} "
                f"(need {required}); max_abs={max_abs:.4g} max_rel={max_rel:.4g}"
            )
        result.merge(one)
    return result


def _compare_many(calls: list[tuple[list[torch.Tensor], list[torch.Tensor]]], names: list[str], tol: Tolerance,
                  required: float) -> list[CheckResult]:
    """_compare of each call, with one read of the device for all of them. A call that fails a
    structural test is judged by _compare itself, so its verdict and message are the same."""
    shaped = [all(isinstance(o, torch.Tensor) and tuple(o.shape) == tuple(r.shape) and o.dtype == r.dtype
                  for o, r in zip(outs, refs)) for outs, refs in calls]
    pairs = [(o, r) for (outs, refs), ok in zip(calls, shaped) if ok for o, r in zip(outs, refs)]
    stats = iter(error_stats_many(pairs, tol))
    results = []
    for (outs, refs), ok in zip(calls, shaped):
        mine = [next(stats) for _ in zip(outs, refs)] if ok else [None]
        results.append(_compare(outs, refs, names, tol, required, stats=mine) if all(s is not None for s in mine)
                       else _compare(outs, refs, names, tol, required))
    return results


@register_checker("elementwise")
def check_elementwise(outputs, refs, names, tol: Tolerance) -> CheckResult:
    return _compare(outputs, refs, names, tol, required=1.0)


@register_many("elementwise")
def check_elementwise_many(calls, names, tol: Tolerance) -> list[CheckResult]:
    return _compare_many(calls, names, tol, required=1.0)


@register_checker("matched_ratio")
def check_matched_ratio(outputs, refs, names, tol: Tolerance) -> CheckResult:
    required = tol.matched_ratio if tol.matched_ratio is not None else 0.95
    return _compare(outputs, refs, names, tol, required=required)


@register_many("matched_ratio")
def check_matched_ratio_many(calls, names, tol: Tolerance) -> list[CheckResult]:
    required = tol.matched_ratio if tol.matched_ratio is not None else 0.95
    return _compare_many(calls, names, tol, required=required)
