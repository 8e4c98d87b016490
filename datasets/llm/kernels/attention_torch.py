"""Paged / ragged attention in PyTorch, vectorised over each sequence's GQA groups (no KV head expansion).

Decode gathers the page table into a padded [batch, tokens] index and runs all sequences of a
chunk at once; prefill walks sequences. Softmax state is fp32; lse is base 2.
"""

import math

import torch

_CHUNK_TOKENS = 1 << 20  # bound the gathered K/V per step


def _token_rows(kv_indptr, kv_indices, n_tok, page_size):
    """[B, L] cache rows of every sequence's tokens (padded with 0) and the [B, L] validity mask."""
    batch = n_tok.shape[0]
    length = int(n_tok.max()) if batch else 0
    t = torch.arange(length, device=n_tok.device)
    valid = t[None, :] < n_tok[:, None]
    page_pos = (kv_indptr[:-1, None].long() + t[None, :] // page_size).clamp(max=max(kv_indices.numel() - 1, 0))
    pages = kv_indices.long()[page_pos] if kv_indices.numel() else torch.zeros_like(page_pos)
    rows = torch.where(valid, pages * page_size + t[None, :] % page_size, 0)
    return rows, valid


def _attend(q, k, v, valid, sm_scale):
    """q [B, Hkv, G, D], k/v [B, L, Hkv, D], valid [B, (Q,) L] -> out [B, Hkv, G, Dv], lse2 [B, Hkv, G]."""
    s = torch.einsum("bhgd,blhd->bhgl", q.float(), k.float()) * sm_scale
    s = s.masked_fill(~valid[:, None, None, :], -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None].clamp(min=-1e30)).nan_to_num(0.0)
    return torch.einsum("bhgl,blhd->bhgd", p, v.float()), lse / math.log(2.0)


@torch.no_grad()
def gqa_paged_decode(q, k_cache, v_cache, kv_indptr, kv_indices, *rest):
    last_len, sm_scale = (rest[0], rest[1]) if len(rest) == 2 else (None, rest[0])
    batch, hq, d = q.shape
    _, page_size, hkv, _ = k_cache.shape
    n_pages = (kv_indptr[1:] - kv_indptr[:-1]).long()
    n_tok = n_pages * page_size if last_len is None else torch.where(n_pages > 0, (n_pages - 1) * page_size + last_len.long(), 0)
    k_flat, v_flat = k_cache.reshape(-1, hkv, d), v_cache.reshape(-1, hkv, d)
    output = torch.zeros(batch, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.full((batch, hq), -math.inf, dtype=torch.float32, device=q.device)
    longest = max(int(n_tok.max()) if batch else 1, 1)
    step = max(1, _CHUNK_TOKENS // longest)
    for b0 in range(0, batch, step):
        sl = slice(b0, min(b0 + step, batch))
        rows, valid = _token_rows(kv_indptr[sl.start:sl.stop + 1], kv_indices, n_tok[sl], page_size)
        out, l2 = _attend(q[sl].view(-1, hkv, hq // hkv, d), k_flat[rows], v_flat[rows], valid, sm_scale)
        output[sl] = out.reshape(-1, hq, d).to(q.dtype)
        lse[sl] = l2.reshape(-1, hq)
    return output, lse


def _causal_attend(q, k, v, sm_scale, hkv):
    """One sequence: q [n_q, Hq, Dqk], k [n_kv, Hkv, Dqk], v [n_kv, Hkv, Dv]; the queries are the last n_q tokens."""
    n_q, hq, _ = q.shape
    n_kv = k.shape[0]
    group = hq // hkv
    qg = q.float().view(n_q, hkv, group, -1)
    s = torch.einsum("qhgd,khd->hgqk", qg, k.float()) * sm_scale
    visible = torch.arange(n_kv, device=q.device)[None, :] <= torch.arange(n_q, device=q.device)[:, None] + (n_kv - n_q)
    s = s.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None].clamp(min=-1e30)).nan_to_num(0.0)
    out = torch.einsum("hgqk,khd->qhgd", p, v.float()).reshape(n_q, hq, -1)
    return out, (lse / math.log(2.0)).permute(2, 0, 1).reshape(n_q, hq)


@torch.no_grad()
def gqa_paged_prefill(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale):
    total_q, hq, d = q.shape
    _, page_size, hkv, _ = k_cache.shape
    output = torch.zeros(total_q, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.full((total_q, hq), -math.inf, dtype=torch.float32, device=q.device)
    qo, kvp, last = qo_indptr.tolist(), kv_indptr.tolist(), kv_last_page_len.tolist()
    for b in range(len(qo) - 1):
        if qo[b] == qo[b + 1] or kvp[b] == kvp[b + 1]:
            continue
        pages = kv_indices[kvp[b]:kvp[b + 1]].long()
        n_kv = (len(pages) - 1) * page_size + last[b]
        k = k_cache[pages].reshape(-1, hkv, d)[:n_kv]
        v = v_cache[pages].reshape(-1, hkv, d)[:n_kv]
        for c0 in range(qo[b], qo[b + 1], 1024):  # queries in chunks: bounded memory for long prompts
            c1 = min(c0 + 1024, qo[b + 1])
            kv_end = n_kv - (qo[b + 1] - c1)  # keys after the chunk's last query are never visible
            if kv_end <= 0:
                continue
            out, l2 = _causal_attend(q[c0:c1], k[:kv_end], v[:kv_end], sm_scale, hkv)
            output[c0:c1] = out.to(q.dtype)
            lse[c0:c1] = l2
    return output, lse


@torch.no_grad()
def gqa_ragged_prefill(q, k, v, qo_indptr, kv_indptr, sm_scale):
    total_q, hq, _ = q.shape
    hkv, dv = v.shape[1], v.shape[2]
    output = torch.zeros(total_q, hq, dv, dtype=q.dtype, device=q.device)
    lse = torch.full((total_q, hq), -math.inf, dtype=torch.float32, device=q.device)
    qo, kvp = qo_indptr.tolist(), kv_indptr.tolist()
    for b in range(len(qo) - 1):
        if qo[b] == qo[b + 1] or kvp[b] == kvp[b + 1]:
            continue
        n_kv = kvp[b + 1] - kvp[b]
        for c0 in range(qo[b], qo[b + 1], 1024):
            c1 = min(c0 + 1024, qo[b + 1])
            kv_end = n_kv - (qo[b + 1] - c1)
            if kv_end <= 0:
                continue
            out, l2 = _causal_attend(q[c0:c1], k[kvp[b]:kvp[b] + kv_end], v[kvp[b]:kvp[b] + kv_end], sm_scale, hkv)
            output[c0:c1] = out.to(q.dtype)
            lse[c0:c1] = l2
    return output, lse


@torch.no_grad()
def mla_paged_decode(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale):
    batch, heads, dc = q_nope.shape
    n_tok = (kv_indptr[1:] - kv_indptr[:-1]).long()
    output = torch.zeros(batch, heads, dc, dtype=q_nope.dtype, device=q_nope.device)
    lse = torch.full((batch, heads), -math.inf, dtype=torch.float32, device=q_nope.device)
    longest = max(int(n_tok.max()) if batch else 1, 1)
    step = max(1, _CHUNK_TOKENS // 4 // longest)
    ckv, kpe = ckv_cache[:, 0], kpe_cache[:, 0]
    for b0 in range(0, batch, step):
        sl = slice(b0, min(b0 + step, batch))
        rows, valid = _token_rows(kv_indptr[sl.start:sl.stop + 1], kv_indices, n_tok[sl], 1)
        kc = ckv[rows].float()  # [B, L, 512]
        s = (torch.einsum("bhd,bld->bhl", q_nope[sl].float(), kc)
             + torch.einsum("bhd,bld->bhl", q_pe[sl].float(), kpe[rows].float())) * sm_scale
        s = s.masked_fill(~valid[:, None, :], -math.inf)
        l = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - l[..., None].clamp(min=-1e30)).nan_to_num(0.0)
        output[sl] = torch.einsum("bhl,bld->bhd", p, kc).to(q_nope.dtype)
        lse[sl] = l / math.log(2.0)
    return output, lse
