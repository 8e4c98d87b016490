"""Reproducible timing: CUDA events on a GPU, wall clock on a CPU, latency statistics, and the
bounds a report must meet (the supervisor's clock, the roofline floor)."""

from fibray.timing.bound import BoundBroken, Overhead, bounded_time, calibrate
from fibray.timing.roofline import DeviceCaps, below_floor, device_caps, floor_ms
from fibray.timing.stats import LatencyStats
from fibray.timing.timer import Timing, time_calls

__all__ = ["BoundBroken", "DeviceCaps", "LatencyStats", "Overhead", "Timing", "below_floor", "bounded_time",
           "calibrate", "device_caps", "floor_ms", "time_calls"]
