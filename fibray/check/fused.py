"""The comparison of outputs with references in one pass over each, on a GPU.

`fibray.check.base.output_stats` in torch reads and writes a batch of outputs some thirty times
(widening copies, then every elementwise step to its own temporary): a GPU's check of a timed sample
is bound by that traffic (on an H100, 48 ms a PASSED job over the core set; this kernel is 3.4-4.9x
faster, benchmarks/RESULTS.md, section 35). Here one Triton kernel reads each output and its reference
once, in their own dtypes, and writes a handful of partial sums and maxima per span of a row; torch
folds those. The arithmetic is the same as the torch path's, operation by operation, in the same wide
type (wide_type), with no fused multiply-add and correctly rounded division, so the two give the same
figures (tests/test_check_batch.py, under Triton's interpreter;
benchmarks/check_speed.py on a GPU).

Triton is imported when first needed: on a machine without a GPU the interpreter must be selected
first (fibray.compile.prepare_triton), and the CPU path never needs it.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

BLOCK, STEPS = 1024, 16
"""Elements a program reads at a time, and blocks it reads: each program folds a span of BLOCK * STEPS
elements of one row (every count of a span is exact in float32)."""

FUSED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64,
                          torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64})
"""Output and reference types the kernel reads; others (bool, float8, complex) take the torch path."""

def wide_type(*dtypes: torch.dtype) -> torch.dtype:
    """Where outputs and references are compared: float32 holds every value of a floating-point type of 16
    bits or fewer exactly (and their differences to 2**-24 of the larger), at half float64's traffic, which
    a GPU's check of a timed sample of 128 MiB outputs is bound by; float64 for the rest."""
    narrow = all(d.is_floating_point and d.itemsize <= 2 for d in dtypes)
    return torch.float32 if narrow else torch.float64


_PARTS = 7  # per span: non-finite, of which NaN, max |o - r|, max relative, within, NaN in diff, NaN in rel


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n", "spans"])  # one compile per pair of types, whatever the sizes
    def pair_stats(o_ptr, r_ptr, tol_ptr, part_ptr, n, spans, BLOCK: tl.constexpr, STEPS: tl.constexpr,
                   WIDE64: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        span = tl.program_id(1).to(tl.int64)
        atol = tl.load(tol_ptr)
        rtol = tl.load(tol_ptr + 1)
        eps = tl.load(tol_ptr + 2)
        zero = atol - atol
        bad = tl.zeros([BLOCK], tl.int32)
        nans = tl.zeros([BLOCK], tl.int32)
        within = tl.zeros([BLOCK], tl.int32)
        nan_diff = tl.zeros([BLOCK], tl.int32)
        nan_rel = tl.zeros([BLOCK], tl.int32)
        max_diff = tl.zeros([BLOCK], atol.dtype)
        max_rel = tl.zeros([BLOCK], atol.dtype)
        for step in range(STEPS):
            idx = (span * STEPS + step) * BLOCK + tl.arange(0, BLOCK)
            m = idx < n
            o = tl.load(o_ptr + row * n + idx, mask=m, other=0).to(atol.dtype)
            r = tl.load(r_ptr + row * n + idx, mask=m, other=0).to(atol.dtype)
            o_nan = o != o
            r_nan = r != r
            o_finite = (o == o) & (tl.abs(o) != float("inf"))
            r_finite = (r == r) & (tl.abs(r) != float("inf"))
            wrong = (~o_finite) & ~((o == r) | (o_nan & r_nan)) & m
            bad += wrong.to(tl.int32)
            nans += (wrong & o_nan).to(tl.int32)
            r_abs = tl.abs(r)
            diff = tl.where(r_finite, tl.abs(o - r), zero)
            if WIDE64:  # float64 division is correctly rounded; float32's `/` is not, by default
                rel = diff / (r_abs + eps)
            else:
                rel = tl.math.div_rn(diff, r_abs + eps)
            within += ((diff <= atol + rtol * r_abs) & m).to(tl.int32)
            nan_diff += (diff != diff).to(tl.int32)
            nan_rel += (rel != rel).to(tl.int32)
            max_diff = tl.maximum(max_diff, tl.where(diff != diff, zero, diff))
            max_rel = tl.maximum(max_rel, tl.where(rel != rel, zero, rel))
        out = part_ptr + (row * spans + span) * 7  # _PARTS
        tl.store(out, tl.sum(bad, 0).to(atol.dtype))
        tl.store(out + 1, tl.sum(nans, 0).to(atol.dtype))
        tl.store(out + 2, tl.max(max_diff, 0))
        tl.store(out + 3, tl.max(max_rel, 0))
        tl.store(out + 4, tl.sum(within, 0).to(atol.dtype))
        tl.store(out + 5, tl.sum(nan_diff, 0).to(atol.dtype))
        tl.store(out + 6, tl.sum(nan_rel, 0).to(atol.dtype))

    return pair_stats


def geometry(n: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK, STEPS) for rows of n elements: on a GPU always the same (one compile per pair of types); under
    Triton's interpreter (a CPU) no larger than the rows need, since there every launch is numpy's work."""
    if device.type == "cuda":
        return BLOCK, STEPS
    block = max(16, min(BLOCK, 1 << max(0, n - 1).bit_length()))
    return block, max(1, min(STEPS, -(-n // block)))


def fused_rows(outs: list[torch.Tensor], refs: list[torch.Tensor], wide: torch.dtype, atol: float,
               rtol: float, shape: Optional[tuple[int, int]] = None) -> Optional[torch.Tensor]:
    """[len(outs), 5] float64 on the outputs' device: per pair, its non-finite values where the reference
    has none, how many of them are NaN, max |o - r| where the reference is finite, max |o - r| / (|r| + 1e-8)
    (NaN where any is), and the elements within atol + rtol |r|; what output_stats' torch path computes.
    None where the kernel does not apply (a type it does not read; outputs and references on different
    devices, or not of one shape), so that the caller takes the torch path. `shape`: (BLOCK, STEPS), by default
    `geometry`'s."""
    if not outs or outs[0].dtype not in FUSED_DTYPES or refs[0].dtype not in FUSED_DTYPES:
        return None
    device, n = outs[0].device, outs[0].numel()
    if any(t.device != device or t.numel() != n for t in (*outs, *refs)):
        return None
    o = torch.stack([t.reshape(-1) for t in outs])
    r = torch.stack([t.reshape(-1) for t in refs])
    tol = torch.tensor([atol, rtol, 1e-8], dtype=wide).to(device)
    block, steps = shape or geometry(n, device)
    spans = -(-n // (block * steps))
    part = torch.empty((len(outs), spans, _PARTS), dtype=wide, device=device)
    launch: dict[str, Any] = {} if device.type == "cpu" else {"enable_fp_fusion": False}
    _kernel()[(len(outs), spans)](o, r, tol, part, n, spans, BLOCK=block, STEPS=steps,
                  WIDE64=wide == torch.float64, **launch)
    counts = part[:, :, [0, 1, 4, 5, 6]].double().sum(1)
    nan = torch.tensor(float("nan"), dtype=torch.float64, device=device)
    max_diff = torch.where(counts[:, 3] > 0, nan, part[:, :, 2].amax(1).double())
    max_rel = torch.where(counts[:, 4] > 0, nan, part[:, :, 3].amax(1).double())
    return torch.stack([counts[:, 0], counts[:, 1], max_diff, max_rel, counts[:, 2]], 1)


WARM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""The output types whose kernels a GPU slot compiles as it starts (others compile at their first check)."""


def warm(device: torch.device, dtypes: tuple[torch.dtype, ...] = WARM_DTYPES) -> None:
    """Compile the kernel for outputs and references of each of `dtypes` on `device`, launching nothing (a
    slot's first timed sample would otherwise wait for the compiler inside its timing window)."""
    kernel = _kernel()
    for dtype in dtypes:
        wide = wide_type(dtype)
        o = torch.empty(BLOCK, dtype=dtype, device=device)
        tol = torch.empty(3, dtype=wide, device=device)
        part = torch.empty(_PARTS, dtype=wide, device=device)
        kernel.warmup(o, o, tol, part, BLOCK, 1, BLOCK=BLOCK, STEPS=STEPS, WIDE64=wide == torch.float64,
                      enable_fp_fusion=False, grid=(1, 1))
