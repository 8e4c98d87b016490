"""The roofline floor: the least time a definition's bytes and FLOPs can take on a device.

A reported latency below ROOFLINE_MARGIN x the floor is not a fast kernel but skipped work or
a fooled timer, so it is a verdict (below_roofline), never PASSED. The device's HBM bandwidth
and tensor throughput are measured by the supervisor (a large copy, a large bf16 matmul), once
per process and device; on a CPU there is no floor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from fibray.schema import Definition

ROOFLINE_MARGIN = 0.8
"""A latency below this fraction of the floor is a verdict: measured bandwidth and throughput
are what a copy and a cuBLAS matmul reach, which a kernel may beat by a little (pure reads)."""
LOW_PRECISION_SPEEDUP = 2.0
"""The FLOP floor divides by this times the measured bf16 throughput: fp8 and int8 tensor cores
run twice as fast, and the floor must hold for any dtype."""
_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "float4_e2m1": 0.5,
          "int64": 8, "int32": 4, "int16": 2, "int8": 1, "bool": 1}
_GATHERED: dict[str, tuple[str, ...]] = {
    "gqa_paged": ("_cache",), "mla_paged": ("_cache",), "moe": ("weights",),
}
"""Per op_type, name parts of inputs a correct kernel may read only in part (paged KV caches,
whose pages a batch may not reference; expert weights of experts no token is routed to)."""
_caps: dict[int, "DeviceCaps"] = {}


@dataclass(frozen=True)
class DeviceCaps:
    """What a device can move and compute, as measured."""

    name: str
    """Device name."""
    hbm_bytes_per_s: float
    """Bytes read plus written per second by a large device-to-device copy."""
    matmul_flops_per_s: float
    """FLOPs per second of a large dense bf16 matmul."""


def _numel(definition: Definition, spec, axes: dict[str, int]) -> int:
    shape = definition.shape_of(spec, axes)
    return math.prod(shape) if shape is not None else 1


def min_bytes(definition: Definition, axes: dict[str, int]) -> float:
    """Bytes any correct kernel moves: every output written, every input read once, except inputs
    it may read in part (see _GATHERED)."""
    gathered = _GATHERED.get(definition.op_type, ())
    total = sum(_numel(definition, s, axes) * _BYTES[s.dtype.value] for s in definition.outputs.values())
    for name, spec in definition.inputs.items():
        if not any(part in name for part in gathered):
            total += _numel(definition, spec, axes) * _BYTES[spec.dtype.value]
    return float(total)


def min_flops(definition: Definition, axes: dict[str, int]) -> Optional[float]:
    """FLOPs of a matmul-like definition (op_type gemm): 2 x output elements x the axes its two
    largest inputs share and its output lacks. None where none are derivable."""
    if definition.op_type != "gemm" or len(definition.outputs) != 1:
        return None
    out = next(iter(definition.outputs.values()))
    big = sorted(definition.inputs.values(), key=lambda s: -_numel(definition, s, axes) * _BYTES[s.dtype.value])[:2]
    if len(big) < 2 or not out.shape or not all(s.shape for s in big):
        return None
    contracted = (set(big[0].shape) & set(big[1].shape)) - set(out.shape)
    if not contracted:
        return None
    values = {**axes, **definition.const_axes}
    return 2.0 * _numel(definition, out, axes) * math.prod(int(values[a]) for a in contracted)


def floor_ms(definition: Definition, axes: dict[str, int], caps: DeviceCaps) -> float:
    """The roofline floor: the larger of moving the bytes and doing the FLOPs, in ms."""
    t = min_bytes(definition, axes) / caps.hbm_bytes_per_s
    flops = min_flops(definition, axes)
    if flops is not None:
        t = max(t, flops / (LOW_PRECISION_SPEEDUP * caps.matmul_flops_per_s))
    return t * 1e3


def below_floor(latency_ms: float, definition: Definition, axes: dict[str, int],
                caps: Optional[DeviceCaps]) -> Optional[str]:
    """A message when a latency is below ROOFLINE_MARGIN x the floor; None when it is not (or no caps)."""
    if caps is None:
        return None
    floor = floor_ms(definition, axes, caps)
    if latency_ms >= ROOFLINE_MARGIN * floor:
        return None
    flops = min_flops(definition, axes)
    return (f"latency {latency_ms * 1e3:.2f} us is below {ROOFLINE_MARGIN} x the roofline floor {floor * 1e3:.2f} us "
            f"on {caps.name}: {min_bytes(definition, axes) / 1e6:.3f} MB at {caps.hbm_bytes_per_s / 1e12:.2f} TB/s"
            + (f", {flops / 1e9:.3f} GFLOP at {LOW_PRECISION_SPEEDUP:g} x {caps.matmul_flops_per_s / 1e12:.0f} TFLOP/s"
               if flops is not None else ""))


def device_caps(device: torch.device) -> Optional[DeviceCaps]:
    """The device's measured capabilities (once per process and device); None on a CPU."""
    if device.type != "cuda":
        return None
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _caps:
        _caps[idx] = _measure(torch.device("cuda", idx))
    return _caps[idx]


def _best_ms(fn, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def _measure(device: torch.device) -> DeviceCaps:
    """A 1 GiB copy (bandwidth) and an 8192^3 bf16 matmul (throughput), best of a few."""
    with torch.cuda.device(device):
        n = (1 << 30) // 4
        src = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)
        dst = torch.empty_like(src)
        copy_ms = _best_ms(lambda: dst.copy_(src), 5)
        del src, dst
        m = 8192
        a = torch.randn(m, m, device=device, dtype=torch.bfloat16)
        b = torch.randn(m, m, device=device, dtype=torch.bfloat16)
        mm_ms = _best_ms(lambda: a @ b, 5)
        del a, b
        torch.cuda.empty_cache()
        return DeviceCaps(name=torch.cuda.get_device_name(device), hbm_bytes_per_s=2 * n * 4 / (copy_ms / 1e3),
                          matmul_flops_per_s=2.0 * m ** 3 / (mm_ms / 1e3))
