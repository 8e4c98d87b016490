"""Paged / ragged attention in Triton: decode (paged KV), causal prefill (paged or ragged KV), MLA decode.

All kernels stream the KV sequence in blocks with an online softmax in base 2 (fp32 state),
so the log-sum-exp comes out directly as the 2-based lse of the contract. GQA heads that share
a KV head are packed into the rows of one tile, so K and V are read once per group.
Destination-passing: outputs are written into `output` and `lse`.
"""

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr):
    """tl.dot; on the CPU interpreter in fp32 (its bf16 dot multiplies raw bit patterns)."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        return tl.dot(a, b)


@triton.jit
def _kv_rows(kv_indices_ptr, page_start, t, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, valid):
    """Row index (token slot in the cache) of sequence tokens t."""
    if PAGED:
        page = tl.load(kv_indices_ptr + page_start + t // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        return page * PAGE_SIZE + t % PAGE_SIZE
    else:
        return page_start + t.to(tl.int64)


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
        rows = _kv_rows(kv_indices_ptr, start, t, PAGE_SIZE, True, ok)
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


def gqa_paged_decode(q, k_cache, v_cache, kv_indptr, kv_indices, *rest):
    """(..., [kv_last_page_len,] sm_scale, output, lse); page_size 1 contracts have no kv_last_page_len."""
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
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=triton.next_power_of_2(d),
        BLOCK_N=64 if q.is_cuda else _cpu_block(int((kv_indptr[1:] - kv_indptr[:-1]).max()) * page_size),
        DOT_F32=not q.is_cuda, num_warps=4)


def _cpu_block(longest, cap=128):
    """Tile length on the CPU interpreter, which pays for every (even masked) element: just cover the data."""
    return max(16, min(cap, triton.next_power_of_2(max(longest, 1))))


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, blocks_ptr, qo_indptr_ptr, kv_indptr_ptr, kv_indices_ptr, last_len_ptr,
                    out_ptr, lse_ptr, qk_scale,
                    HQ: tl.constexpr, HKV: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr,
                    PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, DOT_F32: tl.constexpr):
    """One program: BLOCK_M queries of one sequence x the G query heads of KV head h (rows = query*G + head)."""
    blk = tl.program_id(0)
    h = tl.program_id(1)
    G: tl.constexpr = HQ // HKV
    ROWS: tl.constexpr = BLOCK_M * G
    seq = tl.load(blocks_ptr + 2 * blk).to(tl.int64)
    q_first = tl.load(blocks_ptr + 2 * blk + 1)
    qs = tl.load(qo_indptr_ptr + seq)
    n_q = tl.load(qo_indptr_ptr + seq + 1) - qs
    ks = tl.load(kv_indptr_ptr + seq)
    if PAGED:
        n_pages = tl.load(kv_indptr_ptr + seq + 1) - ks
        n_kv = tl.where(n_pages > 0, (n_pages - 1) * PAGE_SIZE + tl.load(last_len_ptr + seq), 0)
    else:
        n_kv = tl.load(kv_indptr_ptr + seq + 1) - ks
    r = tl.arange(0, ROWS)
    qi = q_first + r // G  # query index within the sequence
    head = h * G + r % G
    q_ok = qi < n_q
    dq = tl.arange(0, BLOCK_DQK)
    dv = tl.arange(0, BLOCK_DV)
    q_tok = (qs + qi).to(tl.int64)
    q = tl.load(q_ptr + (q_tok[:, None] * HQ + head[:, None]) * DQK + dq[None, :],
                mask=q_ok[:, None] & (dq[None, :] < DQK), other=0.0)
    last_visible = qi + (n_kv - n_q)  # causal: the queries are the last n_q tokens of the sequence
    kv_end = tl.minimum(n_kv, tl.max(tl.where(q_ok, last_visible, -1)) + 1)
    m = tl.full((ROWS,), float("-inf"), tl.float32)
    l = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, BLOCK_DV), tl.float32)
    for t0 in range(0, kv_end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        ok = t < n_kv
        rows = _kv_rows(kv_indices_ptr, ks, t, PAGE_SIZE, PAGED, ok)
        k = tl.load(k_ptr + (rows[:, None] * HKV + h) * DQK + dq[None, :], mask=ok[:, None] & (dq[None, :] < DQK), other=0.0)
        s = _dot(q, tl.trans(k), DOT_F32) * qk_scale
        visible = ok[None, :] & (t[None, :] <= last_visible[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + (rows[:, None] * HKV + h) * DV + dv[None, :], mask=ok[:, None] & (dv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_F32)
        m = m_new
    has = l > 0
    out = acc / tl.where(has, l, 1.0)[:, None]
    tl.store(out_ptr + (q_tok[:, None] * HQ + head[:, None]) * DV + dv[None, :], out.to(out_ptr.dtype.element_ty),
             mask=q_ok[:, None] & (dv[None, :] < DV))
    tl.store(lse_ptr + q_tok * HQ + head, tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), float("-inf")), mask=q_ok)


def _plan(qo_indptr, block_m):
    """(sequence, first query) of every BLOCK_M-query block: the host-side schedule of the prefill grid."""
    bounds = qo_indptr.tolist()
    blocks = [(s, q0) for s in range(len(bounds) - 1) for q0 in range(0, bounds[s + 1] - bounds[s], block_m)]
    return torch.tensor(blocks, dtype=torch.int32, device=qo_indptr.device).reshape(-1, 2)


def _prefill(q, k, v, qo_indptr, kv_indptr, kv_indices, last_len, sm_scale, output, lse, page_size, paged):
    total_q, hq, dqk = q.shape
    hkv, dv = k.shape[-2], v.shape[-1]
    group = hq // hkv
    if q.is_cuda:
        block_m, block_n = max(1, 64 // group), 64
    else:
        q_lens = (qo_indptr[1:] - qo_indptr[:-1]).max()
        kv_lens = (kv_indptr[1:] - kv_indptr[:-1]).max() * page_size
        block_m = max(1, _cpu_block(int(q_lens) * group) // group)
        block_n = _cpu_block(int(kv_lens))
    blocks = _plan(qo_indptr, block_m)
    if blocks.shape[0] == 0:
        return
    _prefill_kernel[(blocks.shape[0], hkv)](
        q, k, v, blocks, qo_indptr, kv_indptr, kv_indices, last_len, output, lse, float(sm_scale) * LOG2E,
        HQ=hq, HKV=hkv, DQK=dqk, DV=dv, PAGE_SIZE=page_size, PAGED=paged, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_DQK=triton.next_power_of_2(dqk), BLOCK_DV=triton.next_power_of_2(dv),
        DOT_F32=not q.is_cuda, num_warps=4 if dqk <= 128 else 8)


def gqa_paged_prefill(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale, output, lse):
    _prefill(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale, output, lse,
             k_cache.shape[1], True)


def gqa_ragged_prefill(q, k, v, qo_indptr, kv_indptr, sm_scale, output, lse):
    _prefill(q, k, v, qo_indptr, kv_indptr, kv_indptr, kv_indptr, sm_scale, output, lse, 1, False)


@triton.jit
def _mla_decode_kernel(qn_ptr, qp_ptr, ckv_ptr, kpe_ptr, kv_indptr_ptr, kv_indices_ptr, out_ptr, lse_ptr, qk_scale,
                       H: tl.constexpr, DC: tl.constexpr, DP: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr):
    """BLOCK_H heads of one sequence; the compressed cache is both key (with kpe) and value."""
    b = tl.program_id(0).to(tl.int64)
    hh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = hh < H
    dc = tl.arange(0, DC)
    dp = tl.arange(0, DP)
    qn = tl.load(qn_ptr + (b * H + hh[:, None]) * DC + dc[None, :], mask=h_ok[:, None], other=0.0)
    qp = tl.load(qp_ptr + (b * H + hh[:, None]) * DP + dp[None, :], mask=h_ok[:, None], other=0.0)
    start = tl.load(kv_indptr_ptr + b)
    n_tok = tl.load(kv_indptr_ptr + b + 1) - start
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, DC), tl.float32)
    for t0 in range(0, n_tok, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        ok = t < n_tok
        rows = tl.load(kv_indices_ptr + start + t, mask=ok, other=0).to(tl.int64)
        kc = tl.load(ckv_ptr + rows[:, None] * DC + dc[None, :], mask=ok[:, None], other=0.0)
        kp = tl.load(kpe_ptr + rows[:, None] * DP + dp[None, :], mask=ok[:, None], other=0.0)
        s = (_dot(qn, tl.trans(kc), DOT_F32) + _dot(qp, tl.trans(kp), DOT_F32)) * qk_scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(kc.dtype), kc, DOT_F32)
        m = m_new
    has = l > 0
    out = acc / tl.where(has, l, 1.0)[:, None]
    tl.store(out_ptr + (b * H + hh[:, None]) * DC + dc[None, :], out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])
    tl.store(lse_ptr + b * H + hh, tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), float("-inf")), mask=h_ok)


def mla_paged_decode(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale, output, lse):
    batch, heads, dc = q_nope.shape
    if batch == 0:
        return
    block_h = 16
    _mla_decode_kernel[(batch, triton.cdiv(heads, block_h))](
        q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, output, lse, float(sm_scale) * LOG2E,
        H=heads, DC=dc, DP=q_pe.shape[-1], BLOCK_H=block_h,
        BLOCK_N=32 if q_nope.is_cuda else _cpu_block(int((kv_indptr[1:] - kv_indptr[:-1]).max())),
        DOT_F32=not q_nope.is_cuda, num_warps=8)

