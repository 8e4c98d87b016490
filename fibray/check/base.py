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


_CHECKERS: dict[str, Checker] = {}


def register_checker(name: str) -> Callable[[Checker], Checker]:
    """Register a checker under a name a definition's check.kind can use."""

    def deco(fn: Checker) -> Checker:
        _CHECKERS[name] = fn
        return fn

    return deco


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


def error_stats(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> tuple[float, float, float]:
    """(max_abs, max_rel, matched_ratio) with matched meaning |y-ref| <= atol + rtol*|ref|."""
    o, r = out.double(), ref.double()
    if o.numel() == 0:
        return 0.0, 0.0, 1.0
    finite = torch.isfinite(r)
    diff = torch.where(finite, (o - r).abs(), torch.zeros_like(r))
    rel = diff / (r.abs() + 1e-8)
    within = diff <= tol.atol + tol.rtol * r.abs()
    # a count, not mean(): CUDA's mean multiplies by 1/n, and n * (1/n) < 1 for some n (50176 = 7 x 7168
    # gave 0.9999999999999999), which failed outputs whose every element was within tolerance
    return float(diff.max()), float(rel.max()), int(within.sum()) / within.numel()
