"""Reproducible timing: CUDA events on a GPU, wall clock on a CPU, and latency statistics."""

from fibray.timing.stats import LatencyStats
from fibray.timing.timer import time_calls

__all__ = ["LatencyStats", "time_calls"]
