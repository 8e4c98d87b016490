"""A deliberately untuned GQA paged decode (online softmax in base 2, fp32 state) for fibray's built-in search.

One program per (sequence, KV head) streams the sequence's KV tokens in BLOCK_N-long tiles; the query
heads of a group share each K/V tile. Short tiles, one warp, one stage: the search tunes the knobs.
Destination-passing: run(q, k_cache, v_cache, kv_indptr, kv_indices, [kv_last_page_len,] sm_scale, output, lse).
"""

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
BLOCK_N = 16  # fibray-tune: BLOCK_N=[16, 32, 64, 128, 256]
NUM_WARPS = 1  # fibray-tune: NUM_WARPS=[1, 2, 4, 8]
NUM_STAGES = 1  # fibray-tune: NUM_STAGES=[1, 2, 3, 4]
# at most 128 elements of a 128-wide K (or V) tile per thread
# fibray-tune-if: BLOCK_N <= 32 * NUM_WARPS


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr):
    if DOT_F32:  # the CPU interpreter's bf16 dot multiplies raw bit patterns
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        return tl.dot(a, b)


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, kv_indptr_ptr, kv_indices_ptr, last_len_ptr, out_ptr, lse_ptr, qk_scale,
                   HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PAGE_SIZE: tl.constexpr,
                   HAS_LAST: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                   DOT_F32: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    G: tl.constexpr = HQ // HKV
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok, d_ok = g < G, d < D
    heads = h * G + g
    q = tl.load(q_ptr + (b * HQ + heads[:, None]) * D + d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    start = tl.load(kv_indptr_ptr + b)
    n_pages = tl.load(kv_indptr_ptr + b + 1) - start
    if HAS_LAST:
        n_tok = tl.where(n_pages > 0, (n_pages - 1) * PAGE_SIZE + tl.load(last_len_ptr + b), 0)
    else:
        n_tok = n_pages * PAGE_SIZE
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for t0 in range(0, n_tok, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        ok = t < n_tok
        page = tl.load(kv_indices_ptr + start + t // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
        rows = page * PAGE_SIZE + t % PAGE_SIZE
        kv_off = (rows[:, None] * HKV + h) * D + d[None, :]
        k = tl.load(k_ptr + kv_off, mask=ok[:, None] & d_ok[None, :], other=0.0)
        s = _dot(q, tl.trans(k), DOT_F32) * qk_scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_off, mask=ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_F32)
        m = m_new
    has = l > 0
    out = acc / tl.where(has, l, 1.0)[:, None]
    tl.store(out_ptr + (b * HQ + heads[:, None]) * D + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=g_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + b * HQ + heads, tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), float("-inf")), mask=g_ok)


def run(q, k_cache, v_cache, kv_indptr, kv_indices, *rest):
    if len(rest) == 4:
        last_len, sm_scale, output, lse = rest
    else:
        (sm_scale, output, lse), last_len = rest, None
    batch, hq, d = q.shape
    _, page_size, hkv, _ = k_cache.shape
    if batch == 0:
        return
    group = hq // hkv
    _decode_kernel[(batch, hkv)](
        q, k_cache, v_cache, kv_indptr, kv_indices, last_len if last_len is not None else kv_indptr, output, lse,
        float(sm_scale) * LOG2E, HQ=hq, HKV=hkv, D=d, PAGE_SIZE=page_size, HAS_LAST=last_len is not None,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=triton.next_power_of_2(d), BLOCK_N=BLOCK_N,
        DOT_F32=not q.is_cuda, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
