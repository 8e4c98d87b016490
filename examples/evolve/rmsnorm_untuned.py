"""A deliberately untuned RMSNorm (y = x * rsqrt(mean(x^2) + eps) * w) for fibray's built-in search.

One program per row walks the row twice in BLOCK-wide chunks (sum of squares, then scale) with one
warp; the search tunes the knobs below. Destination-passing: run(hidden_states, weight, output).
"""

import triton
import triton.language as tl

EPS = 1e-5  # the rmsnorm_h4096 contract's epsilon
BLOCK = 64  # fibray-tune: BLOCK=[64, 128, 256, 512, 1024, 2048, 4096, 8192]
NUM_WARPS = 1  # fibray-tune: NUM_WARPS=[1, 2, 4, 8, 16]
NUM_STAGES = 1  # fibray-tune: NUM_STAGES=[1, 2, 3, 4]


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, y_ptr, H, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros((BLOCK,), tl.float32)
    for h0 in range(0, H, BLOCK):
        offs = h0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * H + offs, mask=offs < H, other=0.0).to(tl.float32)
        acc += x * x
    inv_rms = tl.rsqrt(tl.sum(acc, axis=0) / H + eps)
    for h0 in range(0, H, BLOCK):
        offs = h0 + tl.arange(0, BLOCK)
        mask = offs < H
        x = tl.load(x_ptr + row * H + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * H + offs, (x * inv_rms * w).to(y_ptr.dtype.element_ty), mask=mask)


def run(hidden_states, weight, output):
    batch, hidden = hidden_states.shape
    if batch == 0:
        return
    _rmsnorm_kernel[(batch,)](hidden_states, weight, output, hidden, EPS, BLOCK=BLOCK,
                              num_warps=NUM_WARPS, num_stages=NUM_STAGES)
