"""Checker registry and the structural checks every checker shares.

A checker compares one trial's outputs with the reference and returns a CheckResult;
it never raises for a wrong answer (a wrong answer is data).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import torch

from fibray.check.fused import fused_rows, wide_type
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


def mismatch(out: Any, ref: torch.Tensor, name: str) -> Optional[CheckResult]:
    """A tensor of the reference's shape and dtype; None when it is one."""
    if not isinstance(out, torch.Tensor):
        return CheckResult(Status.INCORRECT_SHAPE, Reason.NOT_A_TENSOR, f"output {name!r}: got {type(out).__name__}, expected a tensor")
    if tuple(out.shape) != tuple(ref.shape):
        return CheckResult(Status.INCORRECT_SHAPE, Reason.WRONG_SHAPE, f"output {name!r}: shape {tuple(out.shape)}, expected {tuple(ref.shape)}")
    if out.dtype != ref.dtype:
        return CheckResult(Status.INCORRECT_DTYPE, Reason.WRONG_DTYPE, f"output {name!r}: dtype {out.dtype}, expected {ref.dtype}")
    return None


def _nonfinite(o: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of o against r ([calls, elements], float32 or float64): non-finite values where the reference
    has none (NaN against NaN, or the same infinity, is equal), and how many of them are NaN."""
    bad = ~torch.isfinite(o) & ~((o == r) | (torch.isnan(o) & torch.isnan(r)))
    return bad.sum(1), (bad & torch.isnan(o)).sum(1)


def nonfinite_result(name: str, count: int, nans: int) -> CheckResult:
    value = float("nan") if nans else float("inf")
    return CheckResult(Status.INCORRECT_NUMERICAL, Reason.NON_FINITE_OUTPUT,
                       f"output {name!r}: {count} non-finite values where the reference has none",
                       max_abs=value, max_rel=value)


def structural(out: torch.Tensor, ref: torch.Tensor, name: str) -> Optional[CheckResult]:
    """Shape, dtype and finiteness; None when all three hold."""
    bad = mismatch(out, ref, name)
    if bad is not None or not out.dtype.is_floating_point:
        return bad
    count, nans = (int(t) for t in _nonfinite(out.reshape(1, -1).double(), ref.reshape(1, -1).double()))
    return nonfinite_result(name, count, nans) if count else None


BATCH_ELEMENTS = 1 << 24
"""Elements of one output compared in one batch of calls (float64: 128 MiB per temporary)."""


@dataclass(frozen=True)
class OutputStats:
    """One output of one call against its reference: what structural and error_stats judge."""

    nonfinite: int
    nans: int
    max_abs: float
    max_rel: float
    matched_ratio: float


def _rows(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """[len(tensors), elements] in `dtype`, each tensor copied in once (a stack, then a conversion, was two)."""
    rows = torch.empty((len(tensors), tensors[0].numel()), dtype=dtype, device=tensors[0].device)
    for row, t in zip(rows, tensors):
        row.copy_(t.reshape(-1))
    return rows


def output_stats(outs: list[torch.Tensor], refs: list[torch.Tensor], tol: Tolerance,
                 fused: Optional[bool] = None) -> list[OutputStats]:
    """OutputStats of each (out, ref) pair, all of one shape and dtype: a batch of pairs is compared
    with a few launches and read back once, where one pair at a time took some 25 launches and
    four reads each (the judged sample of a job's timed calls is 52 calls). `fused`: through one Triton
    kernel that reads each tensor once (fibray.check.fused), with the same figures; by default on a GPU,
    where the torch path's thirty passes over the batch bound a timed sample's check."""
    n = outs[0].numel() if outs else 0
    if n == 0:
        return [OutputStats(0, 0, 0.0, 0.0, 1.0) for _ in outs]
    floating, per = outs[0].dtype.is_floating_point, max(1, BATCH_ELEMENTS // n)
    wide = wide_type(outs[0].dtype, refs[0].dtype)
    fused = outs[0].device.type == "cuda" if fused is None else fused
    stats: list[OutputStats] = []
    for lo in range(0, len(outs), per):
        table = fused_rows(outs[lo:lo + per], refs[lo:lo + per], wide, tol.atol, tol.rtol) if fused else None
        if table is None:
            table = _torch_rows(outs[lo:lo + per], refs[lo:lo + per], wide, floating, tol)
        stats.extend(OutputStats(int(b), int(k), a, e, int(w) / n) for b, k, a, e, w in table.tolist())
    return stats


def _torch_rows(outs: list[torch.Tensor], refs: list[torch.Tensor], wide: torch.dtype, floating: bool,
                tol: Tolerance) -> torch.Tensor:
    """output_stats' figures of a batch, in torch: [pairs, 5] float64 (fibray.check.fused.fused_rows' table)."""
    o, r = _rows(outs, wide), _rows(refs, wide)
    bad, nans = _nonfinite(o, r) if floating else (torch.zeros(len(o), dtype=torch.int64, device=o.device),) * 2
    diff = torch.where(torch.isfinite(r), (o - r).abs(), torch.zeros_like(r))
    rel = diff / (r.abs() + 1e-8)
    # a count, not mean(): CUDA's mean multiplies by 1/n, and n * (1/n) < 1 for some n (50176 = 7 x 7168
    # gave 0.9999999999999999), which failed outputs whose every element was within tolerance
    within = (diff <= tol.atol + tol.rtol * r.abs()).sum(1)
    return torch.stack([bad.double(), nans.double(), diff.amax(1).double(), rel.amax(1).double(), within.double()], 1)


def error_stats(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> tuple[float, float, float]:
    """(max_abs, max_rel, matched_ratio) with matched meaning |y-ref| <= atol + rtol*|ref|."""
    st = output_stats([out], [ref], tol)[0]
    return st.max_abs, st.max_rel, st.matched_ratio


def judge_calls(checker: Checker, calls: list[list[torch.Tensor]], refs: list[list[torch.Tensor]], names: list[str],
                tol: Tolerance) -> list[CheckResult]:
    """The checker's verdict on each call's outputs against that call's references: at once where
    the checker can judge many calls together (its `many`), else one call at a time."""
    many = getattr(checker, "many", None)
    return many(calls, refs, names, tol) if many is not None else [checker(c, r, names, tol) for c, r in zip(calls, refs)]
