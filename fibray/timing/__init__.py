"""Reproducible timing: CUDA events on a GPU, wall clock on a CPU, and latency statistics."""

from fibray.timing.stats import LatencyStats
from fibray.timing.timer import Timing, time_calls

__all__ = ["LatencyStats", "Timing", "time_calls"]
