"""Time a callable: CUDA events on a GPU, wall clock on a CPU.

On a GPU every timed call is preceded by an L2 flush (a write of twice the device's L2)
and uses its own pair of events on the current stream. Work a candidate hides on another
stream would escape those events, so a second, shorter pass synchronises the whole device
before each end mark; its fixed cost (measured once per process and device on an empty
call, the same way) is subtracted, and if the device-wide figure is clearly longer, it is
the one reported. Inputs rotate between calls so that caching by input cannot pay. Lines a
kernel marked persisting (an access-policy window) would survive the flush: the context's
persisting-L2 set-aside is put to 0 and its persisting lines reset before timing, and again
before any call that finds the set-aside raised.
"""

from __future__ import annotations

import ctypes
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

# Captured at import, before candidate code can replace them in this process.
_perf_counter_ns = time.perf_counter_ns
_Event = torch.cuda.Event
_record = torch.cuda.Event.record
_elapsed = torch.cuda.Event.elapsed_time
_synchronize = torch.cuda.synchronize

ADAPTIVE_MIN_CALLS = 10
"""Adaptive timing (eval.timing=adaptive) makes at least this many timed calls..."""
ADAPTIVE_RSE = 0.01
"""...and stops once the standard error of the mean is below this fraction of the mean (or the
fixed count is reached), as GPU MODE's harness does."""
_FLUSH_MIN_BYTES = 32 << 20
_flush_buffers: dict[int, torch.Tensor] = {}
_sync_overheads: dict[tuple[int, bool], float] = {}
_event_pools = threading.local()


@dataclass
class Timing:
    """Per-call latencies (ms) and how they were taken."""

    samples_ms: list[float]
    mode: str  # wall_clock | stream_events | device_sync
    sync_overhead_ms: float = 0.0


_CU_LIMIT_PERSISTING_L2_CACHE_SIZE = 0x06
_cuda_driver: list = []  # [libcuda] once loaded, [None] where it cannot be


def _driver():
    if not _cuda_driver:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            lib.cuCtxGetLimit.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.c_int]
            lib.cuCtxSetLimit.argtypes = [ctypes.c_int, ctypes.c_size_t]
            _cuda_driver.append(lib)
        except (OSError, AttributeError):
            _cuda_driver.append(None)
    return _cuda_driver[0]


def persisting_l2_bytes() -> int:
    """The current context's persisting-L2 set-aside in bytes (0 where there is none or no driver)."""
    lib = _driver()
    value = ctypes.c_size_t(0)
    if lib is None or lib.cuCtxGetLimit(ctypes.byref(value), _CU_LIMIT_PERSISTING_L2_CACHE_SIZE) != 0:
        return 0
    return value.value


def reset_persisting_l2() -> bool:
    """No persisting L2 for what follows: the set-aside to 0, persisting lines back to normal.
    The GPU must be idle (a kernel still running could mark lines again). False without a driver."""
    lib = _driver()
    if lib is None:
        return False
    if persisting_l2_bytes():  # changing the set-aside reconfigures the L2: only when it is not 0 already
        lib.cuCtxSetLimit(_CU_LIMIT_PERSISTING_L2_CACHE_SIZE, 0)
    return lib.cuCtxResetPersistingL2Cache() == 0  # lines a kernel marked persisting and left so


def flush_bytes(device: torch.device) -> int:
    """What one L2 flush writes: twice the device's L2, so that no line of the previous call survives."""
    return max(_FLUSH_MIN_BYTES, 2 * torch.cuda.get_device_properties(device).L2_cache_size)


def _flush_buffer(device: torch.device) -> torch.Tensor:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    buf = _flush_buffers.get(idx)
    if buf is None:
        buf = _flush_buffers[idx] = torch.empty(flush_bytes(device) // 4, dtype=torch.int32, device=device)
    return buf


def _sync_overhead(device: torch.device, arg_sets, flush) -> float:
    """The fixed cost a device-wide synchronise adds to a timed call (an empty call, timed like
    the device-wide pass): a property of the process and device, measured once."""
    key = (device.index if device.index is not None else torch.cuda.current_device(), flush is not None)
    if key not in _sync_overheads:
        _event_pass(_noop, arg_sets, 5, flush, True, None)  # warm
        _sync_overheads[key] = statistics.median(_event_pass(_noop, arg_sets, 50, flush, True, None))
    return _sync_overheads[key]


def device_wide_calls(timed: int) -> int:
    """How many calls the device-wide pass makes after `timed` stream-timed calls."""
    return max(5, timed // 10)


def calls_after_warmup(iterations: int, n_sets: int, device: torch.device, sync_device: bool = True) -> int:
    """How many times time_calls calls `before_each`: once per timed call, both passes."""
    timed = iterations * n_sets
    return timed + (device_wide_calls(timed) if device.type == "cuda" and sync_device else 0)


def time_calls(
    fn: Callable[..., Any],
    arg_sets: Sequence[Sequence[Any]],
    *,
    warmup: int,
    iterations: int,
    device: torch.device,
    flush_l2: bool = True,
    sync_device: bool = True,
    before_each: Callable[[int], None] | None = None,
    adaptive: bool = False,
) -> Timing:
    """Run fn over rotating argument sets: `warmup` untimed calls, then `iterations` timed
    calls per argument set. `before_each(i)` runs untimed before timed call i; i counts on
    through the device-wide pass (calls_after_warmup says how far). `adaptive` stops early once
    the mean is known well enough (ADAPTIVE_RSE); its mode says so ("...+adaptive")."""
    n = len(arg_sets)
    if device.type == "cuda":
        timing = _time_cuda(fn, arg_sets, warmup, iterations * n, device, flush_l2, sync_device, before_each, adaptive)
    else:
        for i in range(warmup):
            fn(*arg_sets[i % n])
        samples: list[float] = []
        for i in range(iterations * n):
            if before_each is not None:
                before_each(i)
            args = arg_sets[i % n]
            t0 = _perf_counter_ns()
            fn(*args)
            samples.append((_perf_counter_ns() - t0) / 1e6)
            if adaptive and _settled(samples):
                break
        timing = Timing(samples, "wall_clock")
    if adaptive:
        timing.mode += "+adaptive"
    return timing


def _settled(samples: list[float]) -> bool:
    """Enough calls that the mean's standard error is below ADAPTIVE_RSE of it."""
    n = len(samples)
    if n < ADAPTIVE_MIN_CALLS:
        return False
    mean = statistics.fmean(samples)
    return mean > 0 and statistics.stdev(samples) / (n ** 0.5 * mean) < ADAPTIVE_RSE


def _events(total: int) -> tuple[list, list]:
    """Start and end events for `total` calls, reused across timings by this thread
    (creating ~300 events per timing cost about a millisecond of the GPU's exclusive time)."""
    pool = getattr(_event_pools, "pool", None)
    if pool is None:
        pool = _event_pools.pool = ([], [])
    starts, ends = pool
    while len(starts) < total:
        starts.append(_Event(enable_timing=True))
        ends.append(_Event(enable_timing=True))
    return starts, ends


def _event_pass(fn, arg_sets, total, flush, device_sync, before_each, first: int = 0,
                adaptive: bool = False) -> list[float]:
    n = len(arg_sets)
    starts, ends = _events(total)
    made, seen = total, []
    for i in range(total):
        if before_each is not None:
            before_each(first + i)
        if flush is not None and persisting_l2_bytes():  # the last call raised it: idle, then reset
            _synchronize()
            reset_persisting_l2()
        if flush is not None:
            flush.zero_()
        _record(starts[i])
        fn(*arg_sets[(first + i) % n])
        if device_sync:
            _synchronize()
        _record(ends[i])
        if device_sync or adaptive:  # adaptive reads each call's time before deciding on the next
            _synchronize()
        if adaptive:
            seen.append(_elapsed(starts[i], ends[i]))
            if _settled(seen):
                made = i + 1
                break
    _synchronize()
    return [_elapsed(starts[i], ends[i]) for i in range(made)]


def _noop(*_: Any) -> None:
    return None


def _time_cuda(fn, arg_sets, warmup, total, device, flush_l2, sync_device, before_each, adaptive=False) -> Timing:
    n = len(arg_sets)
    with torch.cuda.device(device):
        for i in range(warmup):
            fn(*arg_sets[i % n])
        _synchronize()
        flush = _flush_buffer(device) if flush_l2 else None
        if flush is not None:
            reset_persisting_l2()
        stream = _event_pass(fn, arg_sets, total, flush, False, before_each, adaptive=adaptive)
        if not sync_device:
            return Timing(stream, "stream_events")
        overhead = _sync_overhead(device, arg_sets, flush)
        device_wide = [max(s - overhead, 0.0)
                       for s in _event_pass(fn, arg_sets, device_wide_calls(len(stream)), flush, True, before_each, first=total)]
        if statistics.median(device_wide) > 1.25 * statistics.median(stream) + 0.005:
            return Timing(device_wide, "device_sync", overhead)  # work escaped the current stream
        return Timing(stream, "stream_events", overhead)
