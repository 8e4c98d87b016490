"""Time a callable: CUDA events on a GPU (L2 flushed, whole device synchronised before the
end mark), wall clock on a CPU. Inputs rotate between calls so caching by input cannot pay.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch

_L2_FLUSH_BYTES = 256 * 1024 * 1024  # above any current GPU's L2 (H200: 60 MB)
_flush_buffers: dict[int, torch.Tensor] = {}


def _flush_buffer(device: torch.device) -> torch.Tensor:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    buf = _flush_buffers.get(idx)
    if buf is None:
        buf = _flush_buffers[idx] = torch.empty(_L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    return buf


def time_calls(
    fn: Callable[..., Any],
    arg_sets: Sequence[Sequence[Any]],
    *,
    warmup: int,
    iterations: int,
    device: torch.device,
    flush_l2: bool = True,
    sync_device: bool = True,
) -> list[float]:
    """Run fn over rotating argument sets; return per-call latencies in ms.

    warmup calls are untimed; then `iterations` timed calls per argument set.
    """
    n = len(arg_sets)
    if device.type == "cuda":
        return _time_cuda(fn, arg_sets, warmup, iterations * n, device, flush_l2, sync_device)
    for i in range(warmup):
        fn(*arg_sets[i % n])
    samples = []
    for i in range(iterations * n):
        args = arg_sets[i % n]
        t0 = time.perf_counter_ns()
        fn(*args)
        samples.append((time.perf_counter_ns() - t0) / 1e6)
    return samples


def _time_cuda(fn, arg_sets, warmup, total, device, flush_l2, sync_device) -> list[float]:
    n = len(arg_sets)
    with torch.cuda.device(device):
        for i in range(warmup):
            fn(*arg_sets[i % n])
        torch.cuda.synchronize()
        flush = _flush_buffer(device) if flush_l2 else None
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(total)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(total)]
        for i in range(total):
            if flush is not None:
                flush.zero_()
            starts[i].record()
            fn(*arg_sets[i % n])
            if sync_device:
                torch.cuda.synchronize()  # work the candidate put on other streams is counted
            ends[i].record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in zip(starts, ends)]
