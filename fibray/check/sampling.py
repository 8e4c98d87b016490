"""Sampling checker: the exact filtered distribution against many draws of the candidate.

A sampler is stochastic, so one call proves little. A checker marked `@needs_draws` declares
it; the candidate side then makes a `DrawPlan` (`draw_plan`) and calls the candidate again on
inputs whose batch is tiled R times, so one call gives R draws of every row (`collect_draws`),
and the judge passes the stacked samples in `Draws`. Any token outside the top-k / top-p
filter is an immediate failure (`masked_token_sampled`); otherwise each row's total variation
distance must stay under a bound that a correct sampler exceeds with probability below 1e-9
(`tvd_exceeded`). It never compares against the reference's own samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar, Union

import torch

from fibray.check.base import Checker, CheckResult, Status, Tolerance, checker_for, register_checker, structural
from fibray.schema import Definition
from fibray.schema.reasons import Reason

__all__ = ["DrawPlan", "Draws", "FilteredDistribution", "check_sampling", "collect_draws", "draw_plan",
           "filtered_distribution", "needs_draws", "tvd_bound", "wants_draws"]

DEFAULT_DRAWS = 1000
"""Draws per row when the definition's check does not set `draws`."""
FALSE_FAILURE = 1e-9
"""Probability that a correct sampler fails the TVD bound on one workload (union over rows)."""
AMBIGUOUS_MASS = 1e-5
"""Tokens whose mass-above is this close to the top-p cut may be sampled without an immediate failure."""
_SEED = 0x5A3D1E
_TILE_BYTES = {"cuda": 1 << 30, "cpu": 32 << 20}
"""Bytes of tiled batch inputs per call, by device type."""

T = TypeVar("T")


def needs_draws(fn: Checker) -> Checker:
    """Mark a checker as one that judges many draws (it is called with `draws=Draws(...)`)."""
    fn.wants_draws = True  # type: ignore[attr-defined]
    return fn


def wants_draws(checker: Checker) -> bool:
    """True when the checker judges many draws of the candidate."""
    return bool(getattr(checker, "wants_draws", False))


@dataclass(frozen=True)
class DrawPlan:
    """How the candidate side makes the draws: `calls` calls on the batch tiled `reps` times."""

    batch_axis: str
    """Var axis whose inputs are tiled (the first axis of the first output)."""
    batch: int
    """Rows of the workload."""
    reps: int
    """Copies of the batch per call (draws per row per call)."""
    calls: int
    """Calls to make; draws per row = calls * reps."""


@dataclass(frozen=True)
class Draws:
    """What the judge passes to a `@needs_draws` checker."""

    definition: Definition
    """The definition (input names and shapes)."""
    inputs: list[Any]
    """This trial's inputs, in definition order (the judge's copy)."""
    samples: Optional[torch.Tensor]
    """[calls * reps, batch] outputs of the repeated calls; None when only one call was made."""


def draw_plan(definition: Definition, args: list[Any]) -> Optional[DrawPlan]:
    """The plan for a definition whose checker needs draws, else None."""
    kind = definition.check.kind if definition.check else "elementwise"
    if not wants_draws(checker_for(kind)):
        return None
    extra = getattr(definition.check, "model_extra", None) or {}
    n = int(extra.get("draws", DEFAULT_DRAWS))
    spec = next(iter(definition.outputs.values()))
    if not spec.shape:
        raise ValueError(f"{definition.name}: check.kind {kind!r} needs an output with a batch axis")
    axis = spec.shape[0]
    tiled = [a for a, s in zip(args, definition.inputs.values()) if isinstance(a, torch.Tensor) and s.shape and s.shape[0] == axis]
    if not tiled:
        raise ValueError(f"{definition.name}: no input has the batch axis {axis!r}")
    row_bytes = sum(t.numel() * t.element_size() for t in tiled)
    budget = _TILE_BYTES.get(tiled[0].device.type, _TILE_BYTES["cpu"])
    calls = math.ceil(n / max(1, min(n, budget // max(row_bytes, 1))))
    return DrawPlan(batch_axis=axis, batch=int(tiled[0].shape[0]), reps=math.ceil(n / calls), calls=calls)


def _tile(definition: Definition, args: list[Any], plan: DrawPlan) -> list[Any]:
    out = []
    for value, spec in zip(args, definition.inputs.values()):
        if isinstance(value, torch.Tensor) and spec.shape and spec.shape[0] == plan.batch_axis:
            out.append(value.repeat(plan.reps, *([1] * (value.dim() - 1))))
        else:
            out.append(value.clone() if isinstance(value, torch.Tensor) else value)
    return out


def collect_draws(definition: Definition, plan: DrawPlan, args: list[Any], axes: dict[str, int],
                  call: Callable[[list[Any], dict[str, int]], T]) -> Union[torch.Tensor, T]:
    """Make the planned calls (candidate side): [calls * reps, batch] first outputs, or the first failed call.

    `call(args, axes)` calls the candidate once and returns an object with `.outputs` and
    `.failure` (the candidate side's TrialOutput); one with a failure is returned as is. A first
    output of the wrong size comes back flattened (1-D), for the judge to reject as wrong_shape.
    """
    tiled_axes = {**axes, plan.batch_axis: plan.batch * plan.reps}
    rows = []
    for i in range(plan.calls):
        torch.manual_seed(_SEED + i)  # reproducible verdicts for samplers that use torch's generator
        out = call(_tile(definition, args, plan), tiled_axes)
        if getattr(out, "failure", None) is not None:
            return out
        first = out.outputs[0] if out.outputs else None
        if not isinstance(first, torch.Tensor):
            return torch.empty(0, dtype=torch.int64)
        if first.numel() != plan.batch * plan.reps:
            return first.detach().to("cpu").reshape(-1)
        rows.append(first.detach().to("cpu").reshape(plan.reps, plan.batch))
    return torch.cat(rows)


# ---------------------------------------------------------------------------------------------
# the exact distribution
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FilteredDistribution:
    """Per row: the exact filtered distribution and which tokens may never be sampled."""

    probs: torch.Tensor
    """[B, V] fp64, rows sum to 1 over the kept tokens, 0 elsewhere."""
    forbidden: torch.Tensor
    """[B, V] bool: filtered out beyond any rounding doubt."""


def filtered_distribution(probs: torch.Tensor, top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor]) -> FilteredDistribution:
    """The top-k / top-p rule of the sampling definitions, with ties at a boundary kept.

    top-k keeps a token when fewer than k tokens are strictly more probable (k <= 0 or k >= V:
    no filter); top-p then keeps a token when the strictly more probable kept tokens hold less
    than top_p of the kept mass (the most probable token always stays; top_p >= 1: no filter).
    """
    p = probs.detach().to("cpu", torch.float64)
    b, v = p.shape
    asc, _ = torch.sort(p, dim=-1)
    above_count = v - torch.searchsorted(asc, p, right=True)
    suffix = torch.cat([asc.flip(-1).cumsum(-1).flip(-1), torch.zeros(b, 1, dtype=torch.float64)], dim=-1)
    mass_above = torch.gather(suffix, 1, v - above_count)
    keep = torch.ones_like(p, dtype=torch.bool)
    if top_k is not None:
        k = top_k.detach().to("cpu", torch.int64)[:, None]
        active = (k > 0) & (k < v)
        keep &= ~active | (above_count < k)
    ambiguous = torch.zeros_like(keep)
    if top_p is not None:
        tp = top_p.detach().to("cpu", torch.float64)[:, None]
        cut = tp * torch.where(keep, p, 0.0).sum(-1, keepdim=True)
        top = p == torch.where(keep, p, -1.0).amax(-1, keepdim=True)
        filtered = tp < 1.0
        in_p = (mass_above < cut) | top
        ambiguous = filtered & keep & ((mass_above - cut).abs() < AMBIGUOUS_MASS)
        keep &= ~filtered | in_p
    q = torch.where(keep, p, 0.0)
    q = q / q.sum(-1, keepdim=True)
    return FilteredDistribution(probs=q, forbidden=~keep & ~ambiguous)


def _expected_tvd(q: torch.Tensor, n: int) -> torch.Tensor:
    """E[TVD] between q and the empirical distribution of n draws from q, per row (exact).

    Uses de Moivre's mean absolute deviation of a binomial: E|X - np| =
    2 (m+1) C(n, m+1) p^(m+1) (1-p)^(n-m) with m = floor(np).
    """
    p = q.clamp(0.0, 1.0)
    m = torch.floor(n * p)
    inner = (p > 0) & (p < 1) & (m < n)
    ps, ms = torch.where(inner, p, 0.5), torch.where(inner, m, 0.0)
    log_mad = (math.log(2.0) + torch.log(ms + 1) + math.lgamma(n + 1) - torch.lgamma(ms + 2) - torch.lgamma(n - ms)
               + (ms + 1) * torch.log(ps) + (n - ms) * torch.log1p(-ps))
    mad = torch.where(inner, torch.exp(log_mad), 0.0)
    return 0.5 * mad.sum(-1) / n


def tvd_bound(q: torch.Tensor, n: int, false_failure: float = FALSE_FAILURE) -> torch.Tensor:
    """Per-row TVD bound for n draws: expectation plus a McDiarmid term (one draw moves TVD by <= 1/n)."""
    rows = q.shape[0]
    return _expected_tvd(q, n) + math.sqrt(math.log(max(rows, 1) / false_failure) / (2 * n))


# ---------------------------------------------------------------------------------------------
# judging
# ---------------------------------------------------------------------------------------------
def _masked(tokens: torch.Tensor, dist: FilteredDistribution) -> Optional[CheckResult]:
    """A failure when some draw is out of range or filtered out; tokens is [R, B]."""
    v = dist.probs.shape[1]
    bad_range = (tokens < 0) | (tokens >= v)
    if bool(bad_range.any()):
        t = int(tokens[bad_range][0])
        return CheckResult(Status.INCORRECT_NUMERICAL, Reason.MASKED_TOKEN_SAMPLED,
                           f"sampled token id {t} is outside the vocabulary [0, {v})")
    rows = torch.arange(tokens.shape[1]).expand_as(tokens)
    hit = dist.forbidden[rows, tokens]
    if bool(hit.any()):
        r, t = int(rows[hit][0]), int(tokens[hit][0])
        return CheckResult(Status.INCORRECT_NUMERICAL, Reason.MASKED_TOKEN_SAMPLED,
                           f"row {r}: sampled token {t}, which the filter removes "
                           f"({int(hit.sum())} of {hit.numel()} draws were filtered-out tokens)")
    return None


@register_checker("sampling")
@needs_draws
def check_sampling(outputs: list[torch.Tensor], refs: list[torch.Tensor], names: list[str], tol: Tolerance,
                   draws: Optional[Draws] = None) -> CheckResult:
    """Hard mask on every draw, then per-row TVD against the exact filtered distribution."""
    if draws is None:
        raise TypeError("the 'sampling' checker needs draws=Draws(...) from the judge (see fibray.check.sampling)")
    bad = structural(outputs[0], refs[0], names[0])
    if bad is not None:
        return bad
    named = dict(zip(draws.definition.inputs, draws.inputs))
    dist = filtered_distribution(named["probs"], named.get("top_k"), named.get("top_p"))
    batch = dist.probs.shape[0]
    if batch == 0:
        return CheckResult()
    tokens = outputs[0].detach().to("cpu", torch.int64).reshape(1, batch)
    if draws.samples is not None:
        samples = draws.samples
        if samples.dim() != 2 or samples.shape[1] != batch or samples.dtype != refs[0].dtype:
            return CheckResult(Status.INCORRECT_SHAPE, Reason.WRONG_SHAPE,
                               f"repeated calls gave {tuple(samples.shape)} {samples.dtype} samples, "
                               f"expected [draws, {batch}] {refs[0].dtype}")
        tokens = torch.cat([tokens, samples.to("cpu", torch.int64)])
    masked = _masked(tokens, dist)
    if masked is not None:
        return masked
    if draws.samples is None:
        return CheckResult()  # a single call (e.g. the re-check): the mask is all it can prove
    total = tokens.shape[0]
    counts = torch.zeros_like(dist.probs)
    counts.scatter_add_(1, tokens.T.contiguous(), torch.ones(batch, total, dtype=torch.float64))
    tvd = 0.5 * (counts / total - dist.probs).abs().sum(-1)
    bound = tvd_bound(dist.probs, total)
    worst = int(torch.argmax(tvd - bound))
    result = CheckResult(extra={"tvd": float(tvd.max()), "tvd_bound": float(bound[worst]), "draws": total})
    if bool((tvd > bound).any()):
        result.status, result.reason = Status.INCORRECT_NUMERICAL, Reason.TVD_EXCEEDED
        result.message = (f"row {worst}: TVD {float(tvd[worst]):.4f} between {total} draws and the exact filtered "
                          f"distribution exceeds the bound {float(bound[worst]):.4f}")
    return result
