"""Serving by promotion stage: which calls a canary takes, what shadow and canary calls are compared
against, and when an artifact is demoted.

Only shadow and canary solutions reach this module (their SolutionState has `mode` set, so the
hot path sends them down its slow branch); a `default` hit never does. A call's *baseline* is
what would answer it without the staged solution: the next default solution of its key, else
the fallback. Demotion (through the dispatcher's breaker) follows an exception, a NaN/Inf, an
output outside tolerance of the baseline's, or a P99 latency worse than the baseline's over a
window of compared calls.
"""

from __future__ import annotations

import math
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from fibray.apply.dispatch import Entry, SolutionState

SHADOW, CANARY = "shadow", "canary"
"""Staged modes of a SolutionState (None: served plainly, as a default)."""

_GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def _seed(text: str) -> int:
    return zlib.crc32(text.encode()) * 0x1000193 & _MASK


class Sampler:
    """Deterministic sampling of calls: call n is taken when hash(key, n) falls below the fraction.

    The hash is a multiplicative (Weyl) sequence seeded by the key, so a fraction f takes about
    f of every window of calls and the same calls in every run of the same program.
    """

    __slots__ = ("n", "seed", "threshold")

    def __init__(self, key: str, fraction: float) -> None:
        self.n = 0
        self.seed = _seed(key)
        self.threshold = int(min(max(fraction, 0.0), 1.0) * (1 << 64))

    def take(self) -> bool:
        n = self.n
        self.n = n + 1
        return ((n * _GOLDEN + self.seed) & _MASK) < self.threshold


def p99(values: deque[float]) -> float:
    """The 99th percentile (nearest rank) of the values."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


@dataclass
class StageCounters:
    """What one staged artifact did (read through ApplyRuntime.stats())."""

    served: int = 0
    """Calls its result answered (canary)."""
    shadow_calls: int = 0
    """Calls it ran beside the baseline without answering them (shadow)."""
    baseline_calls: int = 0
    """Calls the baseline answered while it was staged."""
    compared: int = 0
    """Calls whose outputs were compared with the baseline's."""
    mismatches: int = 0
    """Compared calls outside tolerance."""
    exceptions: int = 0
    non_finite: int = 0
    p99_ms: float | None = None
    """Its P99 latency over the last window of compared calls, ms."""
    baseline_p99_ms: float | None = None
    """The baseline's P99 over the same calls, ms."""


class StageMonitor:
    """Sampling, comparison and latency window of one shadow or canary artifact."""

    def __init__(self, mode: str, artifact: str, *, canary_fraction: float, compare_fraction: float,
                 compare_first: int, shadow_fraction: float, atol: float, rtol: float, window: int,
                 margin: float, cuda: bool) -> None:
        self.mode = mode
        self.counters = StageCounters()
        self.serve = Sampler(f"{artifact}:serve", canary_fraction if mode == CANARY else 0.0)
        self.compare = Sampler(f"{artifact}:compare", compare_fraction)
        self.shadow = Sampler(f"{artifact}:shadow", shadow_fraction)
        self.compare_first = compare_first
        self.atol, self.rtol = atol, rtol
        self.window, self.margin = window, margin
        self.mine: deque[float] = deque(maxlen=window)
        self.base: deque[float] = deque(maxlen=window)
        self._since_check = 0
        self._sync = torch.cuda.synchronize if cuda else None

    def timed(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        """fn's result and its latency in ms (on CUDA, the device is synchronised around it)."""
        if self._sync is not None:
            self._sync()
        t0 = time.perf_counter()
        out = fn()
        if self._sync is not None:
            self._sync()
        return out, (time.perf_counter() - t0) * 1e3

    def compare_this(self) -> bool:
        """Whether this canary-served call is compared (the first `compare_first`, then a sample)."""
        if self.counters.served < self.compare_first:
            return True
        return self.compare.take()

    def mismatch(self, mine: Any, base: Any) -> str | None:
        """Why the outputs differ beyond |y - b| <= atol + rtol * |b|, or None."""
        ys = mine if isinstance(mine, (tuple, list)) else (mine,)
        bs = base if isinstance(base, (tuple, list)) else (base,)
        if len(ys) != len(bs):
            return f"returned {len(ys)} outputs, the baseline {len(bs)}"
        for i, (y, b) in enumerate(zip(ys, bs)):
            if not isinstance(y, torch.Tensor) or not isinstance(b, torch.Tensor):
                continue
            if y.shape != b.shape or y.dtype != b.dtype:
                return f"output {i}: {tuple(y.shape)} {y.dtype}, the baseline's {tuple(b.shape)} {b.dtype}"
            if not (y.is_floating_point() or b.is_floating_point()):
                if not torch.equal(y, b):
                    return f"output {i}: differs from the baseline's"
                continue
            yf, bf = y.float(), b.float()
            err = (yf - bf).abs()
            bound = self.atol + self.rtol * bf.abs()
            bad = ~(err <= bound)  # NaN counts as outside
            if bool(bad.any()):
                worst = float(torch.nan_to_num(err, nan=math.inf).max())
                return (f"output {i}: {int(bad.sum())}/{bad.numel()} elements outside atol {self.atol:g} + rtol "
                        f"{self.rtol:g} of the baseline (max abs error {worst:.3g})")
        return None

    def latency(self, mine_ms: float, base_ms: float) -> str | None:
        """Add one compared call's latencies; why its P99 is worse than the baseline's, or None."""
        self.mine.append(mine_ms)
        self.base.append(base_ms)
        self._since_check += 1
        if len(self.mine) < self.window or self._since_check < max(1, self.window // 4):
            return None
        self._since_check = 0
        mine_p99, base_p99 = p99(self.mine), p99(self.base)
        self.counters.p99_ms, self.counters.baseline_p99_ms = mine_p99, base_p99
        if mine_p99 > base_p99 * (1 + self.margin):
            return (f"P99 latency {mine_p99:.4g} ms over the last {len(self.mine)} compared calls, the baseline's "
                    f"{base_p99:.4g} ms (+{100 * self.margin:.0f}% allowed)")
        return None


def all_finite(outputs: Any) -> bool:
    """Whether no floating-point output holds a NaN or an Inf."""
    if isinstance(outputs, torch.Tensor):
        return not outputs.is_floating_point() or bool(torch.isfinite(outputs).all())
    return all(all_finite(o) for o in outputs)


class StagedCalls:
    """The Dispatcher's calls of staged solutions (a mixin: it uses the dispatcher's own safety net,
    `_normalize`, `_outputs_ok`, `_raised`, `_failed`, `_on_failure`, and its counters)."""

    def _run(self, state: SolutionState, entry: Entry, args: tuple) -> Any:
        """One call of a solution on the inputs: its result as a value-returning caller gets it."""
        if state.dps:
            device = args[self._first].device
            outs = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in entry.outs]
            state.fn(*args, *outs)
            return outs[0] if self.n_out == 1 else tuple(outs)
        return self._normalize(state.fn(*args))

    def _baseline(self, entry: Entry, fallback: Callable[..., Any], args: tuple) -> Any:
        """The answer without the staged solution: its key's default solution, else the fallback."""
        rest = entry.rest
        if rest is None or rest.disabled is not None:
            return fallback(*args)
        try:
            result = self._run(rest, entry, args)
            ok = not rest.check_left or self._outputs_ok(rest, result)
        except Exception as e:  # noqa: BLE001 - the safety net, as on the hot path
            return self._raised(rest, e, fallback, args, {})
        if not ok:
            return self._failed(rest, "returned non-finite outputs", fallback, args, {})
        rest.calls += 1
        self.counts[entry.kind] += 1
        return result

    def _staged(self, state: SolutionState, entry: Entry, args: tuple, baseline: Callable[[], Any]) -> Any:
        """A canary answers its sampled calls (some compared with the baseline); a shadow runs beside
        the baseline, is compared, and the baseline answers. Any failure demotes it."""
        m = state.monitor
        c = m.counters
        if state.mode == CANARY:
            if not m.serve.take():
                c.baseline_calls += 1
                return baseline()
            compare = m.compare_this()
            try:
                result, mine_ms = m.timed(lambda: self._run(state, entry, args))
            except Exception as e:  # noqa: BLE001 - a failing canary never reaches the caller
                c.exceptions += 1
                return self._demote(state, f"raised {type(e).__name__}: {e}", baseline)
            if not all_finite(result):
                c.non_finite += 1
                return self._demote(state, "returned non-finite outputs", baseline)
            if compare:
                base, base_ms = m.timed(baseline)
                if not self._judge(state, result, base, mine_ms, base_ms):
                    return base
            c.served += 1
            state.calls += 1
            self.counts[entry.kind] += 1
            return result
        if not m.shadow.take():
            c.baseline_calls += 1
            return baseline()
        base, base_ms = m.timed(baseline)
        c.baseline_calls += 1
        try:
            result, mine_ms = m.timed(lambda: self._run(state, entry, args))
        except Exception as e:  # noqa: BLE001 - a shadow's failure is recorded, never seen by the caller
            c.exceptions += 1
            self._on_failure(state, f"raised {type(e).__name__}: {e}")
            return base
        c.shadow_calls += 1
        if not all_finite(result):
            c.non_finite += 1
            self._on_failure(state, "returned non-finite outputs")
        else:
            self._judge(state, result, base, mine_ms, base_ms)
        return base

    def _judge(self, state: SolutionState, result: Any, base: Any, mine_ms: float, base_ms: float) -> bool:
        """Compare one call with its baseline; demote on a mismatch (False) or a P99 regression."""
        m = state.monitor
        m.counters.compared += 1
        why = m.mismatch(result, base)
        if why is not None:
            m.counters.mismatches += 1
            self._on_failure(state, f"mismatch: {why}")
            return False
        why = m.latency(mine_ms, base_ms)
        if why is not None:
            self._on_failure(state, why)
        return True

    def _demote(self, state: SolutionState, why: str, baseline: Callable[[], Any]) -> Any:
        self.fallbacks += 1
        self._on_failure(state, why)
        return baseline()

    def _general_staged(self, state: SolutionState, entry: Entry, fallback: Callable[..., Any], args: tuple,
                        kwargs: dict[str, Any], call_args: tuple) -> Any:
        """A destination-passing caller of a staged solution: the fallback writes the caller's outputs as
        the baseline; a canary's answer, when it serves, is copied over them."""
        outs = call_args[self.n_in:]

        def baseline() -> Any:
            fallback(*args, **kwargs)
            return outs[0] if self.n_out == 1 else tuple(outs)

        result = self._staged(state, entry, call_args[: self.n_in], baseline)
        for out, value in zip(outs, (result,) if self.n_out == 1 else result):
            if value is not out:
                out.copy_(value)
        return outs[0] if self.n_out == 1 else tuple(outs)

