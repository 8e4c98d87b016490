"""Warm Triton in an executor before any candidate runs: its driver helpers and a launcher.

An executor serves one solution and has a Triton cache of its own (no cache is shared between
candidates), so without this every executor's first Triton candidate paid, inside its first
timed-trial call, for Triton building its C driver helpers and a launcher with the host compiler.
Done here, in fibray's code before the executor says it is ready, the cost falls in a standby's
warm-up, off the sweep's critical path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fill(out_ptr, value, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, value, mask=offs < n)


def warm_triton(device: torch.device) -> None:
    """Compile and launch one tiny kernel on `device` (a CUDA device) and wait for it."""
    out = torch.zeros(16, device=device)
    _fill[(1,)](out, 1.0, 16, BLOCK=16)
    torch.cuda.synchronize(device)
    if out.sum().item() != 16.0:
        raise RuntimeError("fibray's Triton warm-up kernel computed the wrong value")
