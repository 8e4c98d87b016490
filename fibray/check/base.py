"""Checker registry and the structural checks every checker shares.

A checker compares one trial's outputs with the reference and returns a CheckResult;
it never raises for a wrong answer (a wrong answer is data).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import torch

from fibray.schema import EvaluationStatus
from fibray.schema.reasons import Reason

Status = EvaluationStatus


@dataclass(frozen=True)
class Tolerance:
    """Resolved tolerances for one definition."""

    atol: float
    rtol: float
    matched_ratio: Optional[float] = None


@dataclass
class CheckResult:
    """Verdict of one trial, with error metrics (max over outputs)."""

    status: Status = Status.PASSED
    reason: Optional[str] = None
    message: str = ""
    max_abs: float = 0.0
    max_rel: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == Status.PASSED

    def merge(self, other: "CheckResult") -> "CheckResult":
        """Fold another trial in: metrics take the max, the first failure wins."""
        self.max_abs = _nanmax(self.max_abs, other.max_abs)
        self.max_rel = _nanmax(self.max_rel, other.max_rel)
        for k, v in other.extra.items():
            if k in self.extra and isinstance(v, (int, float)):
                self.extra[k] = min(self.extra[k], v) if k.endswith("ratio") else max(self.extra[k], v)
            else:
                self.extra[k] = v
        if self.ok and not other.ok:
            self.status, self.reason, self.message = other.status, other.reason, other.message
        return self


def _nanmax(a: float, b: float) -> float:
    if a != a or b != b:
        return float("nan")
    return max(a, b)


class Checker(Protocol):
    def __call__(self, outputs: list[torch.Tensor], refs: list[torch.Tensor], names: list[str], tol: Tolerance) -> CheckResult: ...


class ManyChecker(Protocol):
    def __call__(self, calls: list[tuple[list[torch.Tensor], list[torch.Tensor]]], names: list[str],
                 tol: Tolerance) -> list[CheckResult]: ...


_CHECKERS: dict[str, Checker] = {}
_MANY: dict[str, ManyChecker] = {}


def register_checker(name: str) -> Callable[[Checker], Checker]:
    """Register a checker under a name a definition's check.kind can use."""

    def deco(fn: Checker) -> Checker:
        _CHECKERS[name] = fn
        return fn

    return deco


def register_many(name: str) -> Callable[[ManyChecker], ManyChecker]:
    """Register how checker `name` judges many calls at once: the verdict of each call exactly as the
    checker gives it, with fewer waits on the device."""

    def deco(fn: ManyChecker) -> ManyChecker:
        _MANY[name] = fn
        return fn

    return deco


def many_checker_for(kind: str) -> ManyChecker:
    """Judges a list of calls' (outputs, references): the checker's own, or the checker call by call."""
    if kind in _MANY:
        return _MANY[kind]
    one = checker_for(kind)
    return lambda calls, names, tol: [one(outs, refs, names, tol) for outs, refs in calls]


def checker_for(kind: str) -> Checker:
    try:
        return _CHECKERS[kind]
    except KeyError:
        raise ValueError(f"check.kind: unknown checker {kind!r} (have {sorted(_CHECKERS)})") from None


def structural(out: torch.Tensor, ref: torch.Tensor, name: str) -> Optional[CheckResult]:
    """Shape, dtype and finiteness; None when all three hold."""
    if not isinstance(out, torch.Tensor):
        return CheckResult(Status.INCORRECT_SHAPE, Reason.NOT_A_TENSOR, f"output {name!r}: got {type(out).__name__}, expected a tensor")
    if tuple(out.shape) != tuple(ref.shape):
        return CheckResult(Status.INCORRECT_SHAPE, Reason.WRONG_SHAPE, f"output {name!r}: shape {tuple(out.shape)}, expected {tuple(ref.shape)}")
    if out.dtype != ref.dtype:
        return CheckResult(Status.INCORRECT_DTYPE, Reason.WRONG_DTYPE, f"output {name!r}: dtype {out.dtype}, expected {ref.dtype}")
    if out.dtype.is_floating_point:
        o, r = out.float(), ref.float()
        bad = ~torch.isfinite(o) & ~((o == r) | (torch.isnan(o) & torch.isnan(r)))
        if bool(bad.any()):
            value = float("nan") if bool(torch.isnan(o[bad]).any()) else float("inf")
            return CheckResult(
                Status.INCORRECT_NUMERICAL, Reason.NON_FINITE_OUTPUT,
                f"output {name!r}: {int(bad.sum())} non-finite values where the reference has none",
                max_abs=value, max_rel=value,
            )
    return None


def _error_tensors(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """max |y-ref|, max relative error and the count of elements within tolerance, on the device (float64)."""
    o, r = out.double(), ref.double()
    finite = torch.isfinite(r)
    diff = torch.where(finite, (o - r).abs(), torch.zeros_like(r))
    rel = diff / (r.abs() + 1e-8)
    within = diff <= tol.atol + tol.rtol * r.abs()
    # a count, not mean(): CUDA's mean multiplies by 1/n, and n * (1/n) < 1 for some n (50176 = 7 x 7168
    # gave 0.9999999999999999), which failed outputs whose every element was within tolerance
    return diff.max(), rel.max(), within.sum()


def error_stats(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> tuple[float, float, float]:
    """(max_abs, max_rel, matched_ratio) with matched meaning |y-ref| <= atol + rtol*|ref|."""
    if out.numel() == 0:
        return 0.0, 0.0, 1.0
    max_abs, max_rel, within = _error_tensors(out, ref, tol)
    return float(max_abs), float(max_rel), int(within) / out.numel()


def error_stats_many(pairs: list[tuple[torch.Tensor, torch.Tensor]], tol: Tolerance) -> list[Optional[tuple[float, float, float]]]:
    """error_stats of many (output, reference) pairs that pass structural's shape and dtype tests,
    read from the device once: the same numbers, or None for a pair with a non-finite value where
    the reference has none (structural's finiteness test fails there)."""
    rows = []
    for out, ref in pairs:
        bad = torch.zeros((), dtype=torch.float64, device=out.device)
        if out.dtype.is_floating_point:
            o, r = out.float(), ref.float()
            bad = (~torch.isfinite(o) & ~((o == r) | (torch.isnan(o) & torch.isnan(r)))).sum().double()
        if out.numel() == 0:
            rows.append(torch.stack([bad, *torch.zeros(3, dtype=torch.float64, device=out.device)]))
        else:
            rows.append(torch.stack([bad, *(t.double() for t in _error_tensors(out, ref, tol))]))
    if not rows:
        return []
    values = torch.stack([r.to(rows[0].device) for r in rows]).tolist()
    return [None if bad else ((0.0, 0.0, 1.0) if not out.numel() else (max_abs, max_rel, int(within) / out.numel()))
            for (bad, max_abs, max_rel, within), (out, _) in zip(values, pairs)]
