"""Latency statistics over timed samples."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class LatencyStats:
    """Summary of timed iterations, all in milliseconds."""

    median_ms: float
    p95_ms: float
    mean_ms: float
    cv: float
    n: int

    @classmethod
    def of(cls, samples_ms: list[float]) -> "LatencyStats":
        if not samples_ms:
            raise ValueError("no timing samples")
        s = sorted(samples_ms)
        mean = statistics.fmean(s)
        stdev = statistics.pstdev(s) if len(s) > 1 else 0.0
        p95 = s[min(len(s) - 1, max(0, math.ceil(0.95 * len(s)) - 1))]
        return cls(statistics.median(s), p95, mean, stdev / mean if mean > 0 else 0.0, len(s))
