"""Reference sources of the LLM kernel definitions, with @NAME@ placeholders for their constants.

Plain PyTorch that computes in fp32 (fp64 where an integer dot product must stay exact); read by
_serving_defs, which fills the placeholders. Data only: nothing here runs at import.
"""

from __future__ import annotations

__all__ = [
    "FUSED_ADD_RMSNORM_REF", "GEMM_FP8_REF", "GEMM_REF", "GQA_PAGED_DECODE_REF", "GQA_PAGED_PREFILL_REF",
    "GQA_RAGGED_REF", "MLA_DECODE_REF", "MOE_BF16_REF", "MOE_INT8_REF", "RMSNORM_REF", "SAMPLING_REF",
]

RMSNORM_REF = """
import torch


@torch.no_grad()
def run(hidden_states, weight):
    assert hidden_states.shape[-1] == @H@
    x = hidden_states.to(torch.float32)
    variance = (x * x).mean(dim=-1, keepdim=True)
    y = x * torch.rsqrt(variance + @EPS@) * weight.to(torch.float32)
    return y.to(torch.bfloat16)
"""

FUSED_ADD_RMSNORM_REF = """
import torch


@torch.no_grad()
def run(hidden_states, residual, weight):
    assert hidden_states.shape[-1] == @H@
    x = hidden_states.to(torch.float32) + residual.to(torch.float32)
    variance = (x * x).mean(dim=-1, keepdim=True)
    y = x * torch.rsqrt(variance + @EPS@) * weight.to(torch.float32)
    return y.to(torch.bfloat16)
"""

GEMM_REF = """
import torch


@torch.no_grad()
def run(A, B):
    assert B.shape == (@N@, @K@)
    C = A.to(torch.float32) @ B.to(torch.float32).T
    return C.to(A.dtype)
"""

GEMM_FP8_REF = """
import torch

BLOCK = 128


@torch.no_grad()
def run(A, A_scale, B, B_scale):
    M, K = A.shape
    N = B.shape[0]
    assert (N, K) == (@N@, @K@)
    a = A.to(torch.float32).view(M, K // BLOCK, BLOCK) * A_scale.T.unsqueeze(-1)
    b = B.to(torch.float32).view(N // BLOCK, BLOCK, K // BLOCK, BLOCK) * B_scale[:, None, :, None]
    C = a.reshape(M, K) @ b.reshape(N, K).T
    return C.to(torch.bfloat16)
"""

GQA_PAGED_DECODE_REF = """
import math

import torch


@torch.no_grad()
def run(q, k_cache, v_cache, kv_indptr, kv_indices, @LAST_ARG@sm_scale):
    batch_size, num_qo_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_cache.shape
    assert (num_qo_heads, num_kv_heads, head_dim, page_size) == (@HQ@, @HKV@, @D@, @PS@)
    assert kv_indptr.shape[0] == batch_size + 1
    assert kv_indices.shape[0] == int(kv_indptr[-1])
    group = num_qo_heads // num_kv_heads
    output = torch.zeros(batch_size, num_qo_heads, head_dim, dtype=torch.bfloat16, device=q.device)
    lse = torch.full((batch_size, num_qo_heads), -math.inf, dtype=torch.float32, device=q.device)
    for b in range(batch_size):
        start, end = int(kv_indptr[b]), int(kv_indptr[b + 1])
        if start == end:
            continue
        pages = kv_indices[start:end].to(torch.long)
        n_tokens = (end - start - 1) * page_size + @LAST_LEN@
        # gather this sequence's pages, then widen to fp32 (never the whole cache)
        k = k_cache[pages].reshape(-1, num_kv_heads, head_dim)[:n_tokens].to(torch.float32)
        v = v_cache[pages].reshape(-1, num_kv_heads, head_dim)[:n_tokens].to(torch.float32)
        k = k.repeat_interleave(group, dim=1)  # [T, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        logits = torch.einsum("hd,thd->ht", q[b].to(torch.float32), k) * sm_scale
        lse[b] = torch.logsumexp(logits, dim=-1) / math.log(2.0)
        output[b] = torch.einsum("ht,thd->hd", torch.softmax(logits, dim=-1), v).to(torch.bfloat16)
    return output, lse
"""

GQA_PAGED_PREFILL_REF = """
import math

import torch

CHUNK_Q = 512


@torch.no_grad()
def run(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale):
    total_q, num_qo_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_cache.shape
    assert (num_qo_heads, num_kv_heads, head_dim, page_size) == (@HQ@, @HKV@, @D@, @PS@)
    assert total_q == int(qo_indptr[-1]) and kv_indices.shape[0] == int(kv_indptr[-1])
    group = num_qo_heads // num_kv_heads
    output = torch.zeros(total_q, num_qo_heads, head_dim, dtype=torch.bfloat16, device=q.device)
    lse = torch.full((total_q, num_qo_heads), -math.inf, dtype=torch.float32, device=q.device)
    for b in range(qo_indptr.shape[0] - 1):
        qs, qe = int(qo_indptr[b]), int(qo_indptr[b + 1])
        ks, ke = int(kv_indptr[b]), int(kv_indptr[b + 1])
        if qs == qe or ks == ke:
            continue
        pages = kv_indices[ks:ke].to(torch.long)
        n_kv = (ke - ks - 1) * page_size + int(kv_last_page_len[b])
        k = k_cache[pages].reshape(-1, num_kv_heads, head_dim)[:n_kv].to(torch.float32).repeat_interleave(group, dim=1)
        v = v_cache[pages].reshape(-1, num_kv_heads, head_dim)[:n_kv].to(torch.float32).repeat_interleave(group, dim=1)
        n_q = qe - qs
        for c0 in range(0, n_q, CHUNK_Q):  # bounded memory for long prompts
            c1 = min(c0 + CHUNK_Q, n_q)
            logits = torch.einsum("qhd,khd->hqk", q[qs + c0:qs + c1].to(torch.float32), k) * sm_scale
            # query i (of n_q) is token n_kv - n_q + i of its sequence and sees keys 0..that token
            q_pos = torch.arange(c0, c1, device=q.device)[:, None] + (n_kv - n_q)
            logits = logits.masked_fill(torch.arange(n_kv, device=q.device)[None, :] > q_pos, -math.inf)
            lse[qs + c0:qs + c1] = (torch.logsumexp(logits, dim=-1) / math.log(2.0)).T
            attn = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a query with no visible key gives 0
            output[qs + c0:qs + c1] = torch.einsum("hqk,khd->qhd", attn, v).to(torch.bfloat16)
    return output, lse
"""

GQA_RAGGED_REF = """
import math

import torch

CHUNK_Q = 512


@torch.no_grad()
def run(q, k, v, qo_indptr, kv_indptr, sm_scale):
    total_q, num_qo_heads, head_dim_qk = q.shape
    total_kv, num_kv_heads, head_dim_vo = v.shape
    assert (num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo) == (@HQ@, @HKV@, @DQK@, @DVO@)
    assert total_q == int(qo_indptr[-1]) and total_kv == int(kv_indptr[-1])
    group = num_qo_heads // num_kv_heads
    output = torch.zeros(total_q, num_qo_heads, head_dim_vo, dtype=torch.bfloat16, device=q.device)
    lse = torch.full((total_q, num_qo_heads), -math.inf, dtype=torch.float32, device=q.device)
    for b in range(qo_indptr.shape[0] - 1):
        qs, qe = int(qo_indptr[b]), int(qo_indptr[b + 1])
        ks, ke = int(kv_indptr[b]), int(kv_indptr[b + 1])
        if qs == qe or ks == ke:
            continue
        kb = k[ks:ke].to(torch.float32).repeat_interleave(group, dim=1)
        vb = v[ks:ke].to(torch.float32).repeat_interleave(group, dim=1)
        n_q, n_kv = qe - qs, ke - ks
        for c0 in range(0, n_q, CHUNK_Q):  # bounded memory for long prompts
            c1 = min(c0 + CHUNK_Q, n_q)
            logits = torch.einsum("qhd,khd->hqk", q[qs + c0:qs + c1].to(torch.float32), kb) * sm_scale
            q_pos = torch.arange(c0, c1, device=q.device)[:, None] + (n_kv - n_q)
            logits = logits.masked_fill(torch.arange(n_kv, device=q.device)[None, :] > q_pos, -math.inf)
            lse[qs + c0:qs + c1] = (torch.logsumexp(logits, dim=-1) / math.log(2.0)).T
            attn = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a query with no visible key gives 0
            output[qs + c0:qs + c1] = torch.einsum("hqk,khd->qhd", attn, vb).to(torch.bfloat16)
    return output, lse
"""

MLA_DECODE_REF = """
import math

import torch


@torch.no_grad()
def run(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale):
    batch_size, num_qo_heads, head_dim_ckv = q_nope.shape
    head_dim_kpe = q_pe.shape[-1]
    page_size = ckv_cache.shape[1]
    assert (num_qo_heads, head_dim_ckv, head_dim_kpe, page_size) == (@H@, 512, 64, 1)
    assert kv_indptr.shape[0] == batch_size + 1 and kv_indices.shape[0] == int(kv_indptr[-1])
    output = torch.zeros(batch_size, num_qo_heads, head_dim_ckv, dtype=torch.bfloat16, device=q_nope.device)
    lse = torch.full((batch_size, num_qo_heads), -math.inf, dtype=torch.float32, device=q_nope.device)
    for b in range(batch_size):
        start, end = int(kv_indptr[b]), int(kv_indptr[b + 1])
        if start == end:
            continue
        tokens = kv_indices[start:end].to(torch.long)
        kc = ckv_cache[tokens, 0].to(torch.float32)  # the compressed kv is both key (with kpe) and value
        kp = kpe_cache[tokens, 0].to(torch.float32)
        logits = (q_nope[b].to(torch.float32) @ kc.T + q_pe[b].to(torch.float32) @ kp.T) * sm_scale
        lse[b] = torch.logsumexp(logits, dim=-1) / math.log(2.0)
        output[b] = (torch.softmax(logits, dim=-1) @ kc).to(torch.bfloat16)
    return output, lse
"""

MOE_BF16_REF = """
import torch


@torch.no_grad()
def run(hidden_states, routing_logits, gemm1_weights, gemm2_weights):
    E, TOP_K, H, I = @E@, @TOPK@, @H@, @I@
    T = hidden_states.shape[0]
    assert routing_logits.shape == (T, E) and gemm1_weights.shape == (E, 2 * I, H) and gemm2_weights.shape == (E, H, I)
    # routing: top-k of the logits, then softmax over the k chosen (= renormalised top-k of the softmax)
    top_logits, top_ids = torch.topk(routing_logits.to(torch.float32), TOP_K, dim=-1)
    top_w = torch.softmax(top_logits, dim=-1)
    x = hidden_states.to(torch.float32)
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    for e in range(E):
        tok, slot = torch.nonzero(top_ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        g1 = x[tok] @ gemm1_weights[e].to(torch.float32).T  # [n, 2I]: up rows first, then gate
        up, gate = g1[:, :I], g1[:, I:]
        act = torch.nn.functional.silu(gate) * up
        y = act @ gemm2_weights[e].to(torch.float32).T
        out.index_add_(0, tok, y * top_w[tok, slot, None])
    return out.to(torch.bfloat16)
"""

MOE_INT8_REF = """
import torch


@torch.no_grad()
def run(hidden_states, hidden_states_scale, routing_logits, gemm1_weights, gemm1_weights_scale,
        gemm2_weights, gemm2_weights_scale):
    E, TOP_K, H, I = @E@, @TOPK@, @H@, @I@
    T = hidden_states.shape[0]
    assert routing_logits.shape == (T, E) and gemm1_weights.shape == (E, 2 * I, H) and gemm2_weights.shape == (E, H, I)
    top_logits, top_ids = torch.topk(routing_logits.to(torch.float32), TOP_K, dim=-1)
    top_w = torch.softmax(top_logits, dim=-1)
    # int8 x int8 dot products are exact in fp64 (|sum| < 2**53); they are what an int32 MMA computes
    x = hidden_states.to(torch.float64)
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    for e in range(E):
        tok, slot = torch.nonzero(top_ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        acc1 = (x[tok] @ gemm1_weights[e].to(torch.float64).T).to(torch.float32)
        g1 = acc1 * hidden_states_scale[tok, None] * gemm1_weights_scale[e][None, :]
        up, gate = g1[:, :I], g1[:, I:]
        act = torch.nn.functional.silu(gate) * up
        # dynamic per-token symmetric int8 quantisation of the intermediate activation
        a_scale = act.abs().amax(dim=-1, keepdim=True).clamp_min(1e-10) / 127.0
        a_q = torch.round(act / a_scale).clamp_(-127, 127)
        acc2 = (a_q.to(torch.float64) @ gemm2_weights[e].to(torch.float64).T).to(torch.float32)
        y = acc2 * a_scale * gemm2_weights_scale[e][None, :]
        out.index_add_(0, tok, y * top_w[tok, slot, None])
    return out.to(torch.bfloat16)
"""

SAMPLING_REF = """
import torch


@torch.no_grad()
def run(@ARGS@):
    probs = probs.to(torch.float32)
    batch_size, vocab_size = probs.shape
    assert vocab_size == @V@
    p64 = probs.to(torch.float64)
    # ties at a boundary are kept: a token stays when what lies strictly above it satisfies the rule
    asc, _ = torch.sort(p64, dim=-1)
    above = torch.searchsorted(asc, p64, right=True)  # tokens <= p_i, so vocab_size - above are > p_i
    suffix = torch.cat([asc.flip(-1).cumsum(-1).flip(-1), torch.zeros_like(asc[:, :1])], dim=-1)
    mass_above = torch.gather(suffix, 1, above)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if @HAS_K@:
        k = top_k.to(torch.int64)[:, None]
        active = (k > 0) & (k < vocab_size)
        keep &= ~active | ((vocab_size - above) < k)
    if @HAS_P@:
        p = top_p.to(torch.float64)[:, None]
        kept_mass = torch.where(keep, p64, 0.0).sum(-1, keepdim=True)  # renormalise after top-k
        in_p = mass_above < p * kept_mass
        in_p |= p64 == torch.where(keep, p64, -1.0).amax(-1, keepdim=True)  # the top token always stays
        keep &= (p >= 1.0) | in_p
    filtered = torch.where(keep, probs, 0.0)
    return torch.multinomial(filtered, 1).squeeze(-1)
"""
