"""Time a callable: CUDA events on a GPU, wall clock on a CPU.

On a GPU every timed call is preceded by an L2 flush (a write of twice the device's L2)
and uses its own pair of events on the current stream. The calls are timed in chunks, each
queued behind a GPU delay (a spin kernel) sized from the host's measured launch cost, so that
every call of a chunk is in the queue before the GPU reaches it: the events take GPU time,
not Python's launch (fibray.timing.ahead; a guard event checks it, Timing.queued counts it).
A chunk's delay is shortened by the GPU work still queued ahead of it (a lower estimate, from
the delays and the calls of chunks already finished), so the chunks pipeline.
Work a candidate hides on another stream would escape those events, so a second, shorter pass
synchronises the whole device before each end mark (each call behind its own delay); its fixed
cost (measured once per process and device on an empty call, the same way) is subtracted, and
if the device-wide figure is clearly longer, it is the one reported (ahead.choose_mode, with a
hysteresis band per callable). Inputs rotate between calls so that caching by input cannot
pay. Lines a kernel marked persisting (an access-policy window) would survive the flush: the
context's persisting-L2 set-aside is put to 0 and its persisting lines reset before timing,
and again before any call that finds the set-aside raised.
"""

from __future__ import annotations

import ctypes
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from fibray.timing.ahead import Backlog, QueuePlan, choose_mode, sleep_us
from fibray.timing.ahead import previous_mode as _previous_mode
from fibray.timing.ahead import remember_mode as _remember_mode

# Captured at import, before candidate code can replace them in this process.
_perf_counter_ns = time.perf_counter_ns
_Event = torch.cuda.Event
_record = torch.cuda.Event.record
_elapsed = torch.cuda.Event.elapsed_time
_synchronize = torch.cuda.synchronize
_gpu_sleep = torch.cuda._sleep
_query = torch.cuda.Event.query
_current_stream = torch.cuda.current_stream

ADAPTIVE_MIN_CALLS = 10
"""Adaptive timing (eval.timing=adaptive) makes at least this many timed calls..."""
ADAPTIVE_RSE = 0.01
"""...and stops once the standard error of the mean is below this fraction of the mean (or the
fixed count is reached), as GPU MODE's harness does."""
_FLUSH_MIN_BYTES = 32 << 20
_flush_buffers: dict[int, torch.Tensor] = {}
_sync_overheads: dict[tuple[int, bool], float] = {}
_spin_rates: dict[int, float] = {}
DEFAULT_HOST_US = 50.0
"""The host's launch cost per call (us) assumed where no warm-up measured it."""
TIMED_CALL_EXTRA_US = 80.0
"""What a timed call costs the host beyond the call (the flush, two events, the persisting-L2 query,
`before_each`: input changes, a returned result's checks and copy), us: 60-110 us measured on an H100's
host. Only the first chunk's delay rests on it (the next ones on the chunks' measured launch); too low,
and that chunk is one the GPU catches up with."""
_event_pools = threading.local()


@dataclass
class Timing:
    """Per-call latencies (ms) and how they were taken."""

    samples_ms: list[float]
    mode: str  # wall_clock | stream_events | device_sync
    sync_overhead_ms: float = 0.0
    queued: int = -1
    """Stream-timed calls verified queued before the GPU reached them (-1: not a GPU timing)."""
    observed_ms: Optional[list[float]] = None
    """The supervisor's own reading around each timed call (a stepped CPU timing: fibray.timing.steps),
    set only by the supervisor; None where it read none."""
    between_ms: Optional[list[float]] = None
    """With observed_ms: the executor's CPU time after each stepped call (its hand-over), until the next
    call or, after the last, the end step (ms)."""
    reply_ms: Optional[float] = None
    """With observed_ms: the executor's CPU time from its end step until its reply was in (ms)."""
    supervisor_s: float = 0.0
    """With observed_ms: seconds the supervisor spent on its own work between steps, the executor blocked
    (its readings, input changes and snapshots): taken out of the window around the request."""


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


def _sync_overhead(device: torch.device, arg_sets, flush, rate: float) -> float:
    """The fixed cost a device-wide synchronise adds to a timed call (an empty call, timed like
    the device-wide pass): a property of the process and device, measured once."""
    key = (device.index if device.index is not None else torch.cuda.current_device(), flush is not None)
    if key not in _sync_overheads:
        _device_pass(_noop, arg_sets, 5, flush, None, TIMED_CALL_EXTRA_US, rate)  # warm
        _sync_overheads[key] = statistics.median(_device_pass(_noop, arg_sets, 50, flush, None, TIMED_CALL_EXTRA_US, rate))
    return _sync_overheads[key]


def round_trips_s(device: torch.device, rounds: int) -> float:
    """Host seconds for `rounds` launches of an empty kernel, each waited for. On a GPU this process
    has to itself that is a few tens of microseconds a round; while another process's context has
    work, the GPU time-slices and each round waits for that context's slice to end."""
    with torch.cuda.device(device):
        _synchronize()
        t0 = _perf_counter_ns()
        for _ in range(rounds):
            _gpu_sleep(1)
            _synchronize()
        return (_perf_counter_ns() - t0) / 1e9


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
    step: Any = None,
    after_last: Callable[[], None] | None = None,
) -> Timing:
    """Run fn over rotating argument sets: `warmup` untimed calls, then `iterations` timed
    calls per argument set. `before_each(i)` runs untimed before timed call i; i counts on
    through the device-wide pass (calls_after_warmup says how far). `adaptive` stops early once
    the mean is known well enough (ADAPTIVE_RSE); its mode says so ("...+adaptive"). `step` (a
    CPU timing only: fibray.timing.steps.StepPipe) lets the supervisor clock every timed call.
    `after_last` runs untimed after the last timed call (its hand-over: the copy of its outputs), before
    the end step where there are steps."""
    n = len(arg_sets)
    if device.type == "cuda":
        timing = _time_cuda(fn, arg_sets, warmup, iterations * n, device, flush_l2, sync_device, before_each, adaptive)
        if after_last is not None:
            after_last()
    else:
        for i in range(warmup):
            fn(*arg_sets[i % n])
        samples: list[float] = []
        for i in range(iterations * n):
            if step is not None:
                step.begin()
            if before_each is not None:
                before_each(i)
            args = arg_sets[i % n]
            if step is not None:
                step.ready()
            t0 = _perf_counter_ns()
            fn(*args)
            samples.append((_perf_counter_ns() - t0) / 1e6)
            if step is not None:
                step.done()
            if adaptive and _settled(samples):
                break
        if step is not None:
            step.end(after_last)
        elif after_last is not None:
            after_last()
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


def _cycles_per_us(device: torch.device) -> float:
    """The spin kernel's clock (cycles per microsecond), measured once per device with events
    (CUDA 13 dropped the clock rate from the device properties; the boost clock is what spins)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _spin_rates:
        a, b = _Event(enable_timing=True), _Event(enable_timing=True)
        _gpu_sleep(1000)  # loads the kernel
        cycles = 2_000_000
        _record(a)
        _gpu_sleep(cycles)
        _record(b)
        _synchronize()
        _spin_rates[idx] = max(cycles / max(_elapsed(a, b) * 1e3, 1.0), 100.0)
    return _spin_rates[idx]


def _delay(us: float, rate: float) -> None:
    if us > 0:
        _gpu_sleep(int(us * rate))


def _stream_pass(fn, arg_sets, total, flush, before_each, host_us: float, rate: float,
                 adaptive: bool = False) -> tuple[list[float], int, float]:
    """Stream-timed calls in chunks, each queued behind its own GPU delay (QueuePlan), so that the
    events take GPU time only. Returns the latencies, how many calls were verified queued before
    the GPU reached them, and the host's launch cost per call (us) at the end."""
    n = len(arg_sets)
    starts, ends = _events(total)
    guards = _guard_events()
    on = _current_stream()  # once: an event recorded on "the current stream" looks it up again (~30 us of host)
    plan = QueuePlan(total, host_us)
    backlog = Backlog()
    seen: list[float] = []
    done = 0
    while (step := plan.next_chunk(backlog.us(_perf_counter_ns()))) is not None:
        calls, delay_us = step
        launched = _perf_counter_ns()
        _delay(delay_us, rate)
        _record(guards[0], on)
        t0 = _perf_counter_ns()
        for i in range(done, done + calls):
            if before_each is not None:
                before_each(i)
            if flush is not None and persisting_l2_bytes():  # the last call raised it: idle, then reset
                _synchronize()
                reset_persisting_l2()
            if flush is not None:
                flush.zero_()
            _record(starts[i], on)
            fn(*arg_sets[i % n])
            _record(ends[i], on)
        end = _perf_counter_ns()
        ahead = not _query(guards[0])  # the GPU had not reached the chunk's first call when its last was queued
        plan.observe(calls, (end - t0) / 1e9, ahead)
        backlog.queued(launched, end, delay_us, calls, ahead)
        if done and _query(ends[done - 1]):  # the chunk before is done: its GPU time per call
            backlog.learn(_elapsed(starts[backlog.first], ends[done - 1]), done - backlog.first)
        backlog.first = done
        if adaptive:  # reads each chunk's times before deciding on the next
            _synchronize()
            backlog.idle(_perf_counter_ns())
            seen.extend(_elapsed(starts[i], ends[i]) for i in range(done, done + calls))
            if _settled(seen):
                plan.stop()
        done += calls
    _synchronize()
    return [_elapsed(starts[i], ends[i]) for i in range(done)], plan.queued, plan.host_us if plan.delays else 0.0


def _device_pass(fn, arg_sets, total, flush, before_each, host_us: float, rate: float,
                 first: int = 0) -> list[float]:
    """Calls whose end mark follows a synchronise of the whole device (work on any stream is
    inside the window), each queued behind a GPU delay so that its launch is not."""
    n = len(arg_sets)
    starts, ends = _events(total)
    delay_us = sleep_us(host_us, 1)
    on = _current_stream()
    for i in range(total):
        _delay(delay_us, rate)
        if before_each is not None:
            before_each(first + i)
        if flush is not None and persisting_l2_bytes():
            _synchronize()
            reset_persisting_l2()
        if flush is not None:
            flush.zero_()
        _record(starts[i], on)
        fn(*arg_sets[(first + i) % n])
        _synchronize()
        _record(ends[i], on)
        _synchronize()
    return [_elapsed(starts[i], ends[i]) for i in range(total)]


def _guard_events() -> list:
    pool = getattr(_event_pools, "guards", None)
    if pool is None:
        pool = _event_pools.guards = [_Event()]
    return pool


def _noop(*_: Any) -> None:
    return None


def _host_us(fn, arg_sets, warmup: int) -> float:
    """Warm-up calls, timed on the host: the median launch cost of one (the first excluded: it
    compiles), plus what a timed call adds (flush, events, input changes); a default without."""
    n = len(arg_sets)
    costs = []
    for i in range(warmup):
        t0 = _perf_counter_ns()
        fn(*arg_sets[i % n])
        costs.append((_perf_counter_ns() - t0) / 1e3)
    return (statistics.median(costs[1:]) if len(costs) > 1 else DEFAULT_HOST_US) + TIMED_CALL_EXTRA_US


def _time_cuda(fn, arg_sets, warmup, total, device, flush_l2, sync_device, before_each, adaptive=False) -> Timing:
    with torch.cuda.device(device):
        host_us = _host_us(fn, arg_sets, warmup)
        _synchronize()
        rate = _cycles_per_us(device)
        flush = _flush_buffer(device) if flush_l2 else None
        if flush is not None:
            reset_persisting_l2()
        stream, queued, host_us = _stream_pass(fn, arg_sets, total, flush, before_each, host_us, rate, adaptive)
        if not sync_device:
            return Timing(stream, "stream_events", queued=queued)
        overhead = _sync_overhead(device, arg_sets, flush, rate)
        device_wide = [max(s - overhead, 0.0) for s in _device_pass(
            fn, arg_sets, device_wide_calls(len(stream)), flush, before_each, host_us, rate, first=total)]
        mode = choose_mode(statistics.median(stream), statistics.median(device_wide), _previous_mode(fn))
        _remember_mode(fn, mode)
        return Timing(device_wide if mode == "device_sync" else stream, mode, overhead, queued=queued)
