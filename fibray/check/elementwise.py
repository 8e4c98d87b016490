"""Elementwise tolerance and matched-ratio checkers.

elementwise: every element satisfies |y-ref| <= atol + rtol*|ref|.
matched_ratio: at least `matched_ratio` of the elements do (for low-bit kernels).
"""

from __future__ import annotations

import torch

from fibray.check.base import CheckResult, Status, Tolerance, error_stats, register_checker, structural
from fibray.schema.reasons import Reason


def _compare(outputs: list[torch.Tensor], refs: list[torch.Tensor], names: list[str], tol: Tolerance, required: float) -> CheckResult:
    result = CheckResult(extra={"matched_ratio": 1.0})
    for out, ref, name in zip(outputs, refs, names):
        bad = structural(out, ref, name)
        if bad is not None:
            return bad
        max_abs, max_rel, ratio = error_stats(out, ref, tol)
        one = CheckResult(max_abs=max_abs, max_rel=max_rel, extra={"matched_ratio": ratio})
        if ratio < required:
            one.status, one.reason = Status.INCORRECT_NUMERICAL, Reason.TOLERANCE_EXCEEDED
            one.message = (
                f"output {name!r}: {ratio:.6f} of elements within atol={tol.atol} rtol={tol.rtol} "
                f"(need {required}); max_abs={max_abs:.4g} max_rel={max_rel:.4g}"
            )
        result.merge(one)
    return result


@register_checker("elementwise")
def check_elementwise(outputs, refs, names, tol: Tolerance) -> CheckResult:
    return _compare(outputs, refs, names, tol, required=1.0)


@register_checker("matched_ratio")
def check_matched_ratio(outputs, refs, names, tol: Tolerance) -> CheckResult:
    required = tol.matched_ratio if tol.matched_ratio is not None else 0.95
    return _compare(outputs, refs, names, tol, required=required)
