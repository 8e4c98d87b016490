"""C = A @ B.T in Triton: tiled, fp32 accumulation; and the fp8 block-scaled variant (one scale per 128-k step)."""

import triton
import triton.language as tl


@triton.jit
def _gemm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, DOT_F32: tl.constexpr):
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)  # grouped ordering keeps B tiles hot in L2
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


def _tiles(M, device):
    # the interpreter pays per program and per op: few, large tiles; the GPU wants occupancy
    if device.type != "cuda":
        return 16, 512, 256, 4
    if M <= 16:
        return 16, 64, 128, 4
    if M <= 128:
        return 64, 128, 64, 4
    return 128, 128, 64, 8


def gemm(A, B, C):
    M, K = A.shape
    N = B.shape[0]
    if M == 0:
        return
    bm, bn, bk, warps = _tiles(M, A.device)
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    _gemm_kernel[grid](A, B, C, M, N, K, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                       DOT_F32=not A.is_cuda, num_warps=warps, num_stages=3)


@triton.jit
def _fp8_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                DOT_F32: tl.constexpr):
    """One 128-wide k step per iteration: the fp8 dot runs in fp32, then both block scales apply."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, 128)
    num_kb = K // 128
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, num_kb):
        kk = kb * 128 + rk
        a = tl.load(a_ptr + rm[:, None].to(tl.int64) * K + kk[None, :], mask=rm[:, None] < M, other=0.0)
        b = tl.load(b_ptr + rn[None, :].to(tl.int64) * K + kk[:, None], mask=rn[None, :] < N, other=0.0)
        a_s = tl.load(as_ptr + kb * M + rm, mask=rm < M, other=0.0)
        b_s = tl.load(bs_ptr + (rn // 128) * num_kb + kb, mask=rn < N, other=0.0)
        if DOT_F32:  # CPU interpreter: fp8 is exact in fp32, and numpy's fp16 matmul is slow
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
    tl.store(c_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def gemm_fp8_block_scale(A, A_scale, B, B_scale, C):
    M, K = A.shape
    N = B.shape[0]
    if M == 0:
        return
    if A.device.type == "cuda":
        bm, bn, warps = (16 if M <= 16 else 64), 128, 4
    else:
        bm, bn, warps = 16, 512, 4
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    _fp8_kernel[grid](A, A_scale, B, B_scale, C, M, N, K, BLOCK_M=bm, BLOCK_N=bn,
                      DOT_F32=not A.is_cuda, num_warps=warps)
