"""RMSNorm and fused add + RMSNorm in Triton: one program per row, fp32 accumulation, destination-passing."""

import triton
import triton.language as tl

EPS = "@EPS@"  # filled per definition by pack.py


@triton.jit
def _rmsnorm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, H, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + row * H + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(r_ptr + row * H + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    tl.store(y_ptr + row * H + offs, (x * inv_rms * w).to(y_ptr.dtype.element_ty), mask=mask)


def _launch(x, r, w, out, has_residual):
    batch, hidden = x.shape
    if batch == 0:
        return
    _rmsnorm_kernel[(batch,)](x, r, w, out, hidden, EPS, HAS_RESIDUAL=has_residual,
                              BLOCK=triton.next_power_of_2(hidden), num_warps=8)


def rmsnorm(hidden_states, weight, output):
    _launch(hidden_states, hidden_states, weight, output, False)


def fused_add_rmsnorm(hidden_states, residual, weight, output):
    _launch(hidden_states, residual, weight, output, True)
