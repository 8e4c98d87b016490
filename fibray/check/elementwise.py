"""Elementwise tolerance and matched-ratio checkers.

elementwise: every element satisfies |y-ref| <= atol + rtol*|ref|.
matched_ratio: at least `matched_ratio` of the elements do (for low-bit kernels).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fibray.check.base import (
    CheckResult, OutputStats, Status, Tolerance, mismatch, nonfinite_result, output_stats, register_checker,
)
from fibray.schema.reasons import Reason


def _compare_many(calls: list[list[torch.Tensor]], refs: list[list[torch.Tensor]], names: list[str], tol: Tolerance,
                  required: float) -> list[CheckResult]:
    """Each call's outputs against its references, output by output: the first output that is not a
    tensor of the reference's shape and dtype, or has non-finite values where the reference has
    none, decides; otherwise the metrics fold over outputs and the first out of tolerance fails."""
    found: dict[tuple[int, int], OutputStats | CheckResult] = {}  # (call, output): its numbers, or why it has none
    for j, name in enumerate(names):
        groups: dict[tuple, list[int]] = {}
        for i, (outs, rs) in enumerate(zip(calls, refs)):
            if j < min(len(outs), len(rs)):
                bad = found[i, j] = mismatch(outs[j], rs[j], name)
                if bad is None:
                    groups.setdefault((tuple(rs[j].shape), rs[j].dtype, outs[j].device, rs[j].device), []).append(i)
        for members in groups.values():
            stats = output_stats([calls[i][j] for i in members], [refs[i][j] for i in members], tol)
            found.update(((i, j), st) for i, st in zip(members, stats))
    results = []
    for i, (outs, rs) in enumerate(zip(calls, refs)):
        result = CheckResult(extra={"matched_ratio": 1.0})
        for j, name in enumerate(names[:min(len(outs), len(rs))]):
            st = found[i, j]
            if isinstance(st, CheckResult) or st.nonfinite:
                result = st if isinstance(st, CheckResult) else nonfinite_result(name, st.nonfinite, st.nans)
                break
            one = CheckResult(max_abs=st.max_abs, max_rel=st.max_rel, extra={"matched_ratio": st.matched_ratio})
            if st.matched_ratio < required:
                one.status, one.reason = Status.INCORRECT_NUMERICAL, Reason.TOLERANCE_EXCEEDED
                one.message = (
                    f"output {name!r}: {st.matched_ratio:.6f} of elements within atol={tol.atol} rtol={tol.rtol} "
                    f"(need {required}); max_abs={st.max_abs:.4g} max_rel={st.max_rel:.4g}"
                )
            result.merge(one)
        results.append(result)
    return results


def _checker(required: Callable[[Tolerance], float]):
    """A registered checker for one call, with `many` for a batch of calls (fibray.check.base.judge_calls)."""

    def check(outputs, refs, names, tol: Tolerance) -> CheckResult:
        return _compare_many([outputs], [refs], names, tol, required(tol))[0]

    check.many = lambda calls, refs, names, tol: _compare_many(calls, refs, names, tol, required(tol))
    return check


check_elementwise = register_checker("elementwise")(_checker(lambda tol: 1.0))
check_matched_ratio = register_checker("matched_ratio")(
    _checker(lambda tol: tol.matched_ratio if tol.matched_ratio is not None else 0.95))
