"""Causal GQA over ragged sequences: pad to the longest sequence, one batched SDPA call, unpad."""

import torch
import torch.nn.functional as F


def run(q, k, v, qo_indptr, kv_indptr, sm_scale):
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    q_len = (qo_indptr[1:] - qo_indptr[:-1]).long()
    kv_len = (kv_indptr[1:] - kv_indptr[:-1]).long()
    batch = q_len.shape[0]
    lq, lk = int(q_len.max()), int(kv_len.max())
    rows_q = torch.arange(lq, device=q.device)
    rows_k = torch.arange(lk, device=q.device)
    valid_q = rows_q[None, :] < q_len[:, None]                      # [B, Lq]
    valid_k = rows_k[None, :] < kv_len[:, None]                     # [B, Lk]
    qp = q.new_zeros(batch, lq, heads, dim)
    kp = k.new_zeros(batch, lk, kv_heads, dim)
    vp = v.new_zeros(batch, lk, kv_heads, dim)
    qp[valid_q] = q
    kp[valid_k] = k
    vp[valid_k] = v
    group = heads // kv_heads
    kp = kp.repeat_interleave(group, dim=2)
    vp = vp.repeat_interleave(group, dim=2)
    # query i of a sequence sees key j when j <= i + (kv_len - q_len), and j is a real key
    offset = (kv_len - q_len)[:, None, None]
    mask = (rows_k[None, None, :] <= rows_q[None, :, None] + offset) & valid_k[:, None, :]
    mask = mask | ~valid_q[:, :, None]                              # padded queries: any finite row
    out = F.scaled_dot_product_attention(qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2),
                                         attn_mask=mask[:, None], scale=sm_scale)
    return out.transpose(1, 2)[valid_q].contiguous()
