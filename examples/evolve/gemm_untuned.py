"""A deliberately untuned GEMM (C = A @ B.T, fp32 accumulation) for fibray's built-in search.

Small square tiles, no grouped ordering, one warp, one stage: correct everywhere, slow on a GPU. The
search tunes the knobs below. Destination-passing: run(A, B, C).
"""

import triton
import triton.language as tl

BLOCK_M = 16  # fibray-tune: BLOCK_M=[16, 32, 64, 128, 256]
BLOCK_N = 16  # fibray-tune: BLOCK_N=[16, 32, 64, 128, 256]
BLOCK_K = 16  # fibray-tune: BLOCK_K=[16, 32, 64, 128]
GROUP_M = 1  # fibray-tune: GROUP_M=[1, 4, 8, 16]
NUM_WARPS = 1  # fibray-tune: NUM_WARPS=[1, 2, 4, 8]
NUM_STAGES = 1  # fibray-tune: NUM_STAGES=[1, 2, 3, 4, 5]
# at most 128 fp32 accumulators per thread, and the operand tiles of every stage within 192 KiB of shared memory
# fibray-tune-if: BLOCK_M * BLOCK_N <= 128 * 32 * NUM_WARPS
# fibray-tune-if: (BLOCK_M + BLOCK_N) * BLOCK_K * 2 * NUM_STAGES <= 196608


@triton.jit
def _gemm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, DOT_F32: tl.constexpr):
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(a_ptr + rm[:, None].to(tl.int64) * K + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(b_ptr + rn[None, :].to(tl.int64) * K + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        if DOT_F32:  # CPU interpreter: its bf16 dot is wrong and its fp16 dot slow; fp32 is exact here
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def run(A, B, C):
    M, K = A.shape
    N = B.shape[0]
    if M == 0:
        return
    grid = (triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N),)
    _gemm_kernel[grid](A, B, C, M, N, K, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M,
                       DOT_F32=not A.is_cuda, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
