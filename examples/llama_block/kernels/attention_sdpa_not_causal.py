"""A plausible bug: attention over ragged sequences without the causal mask."""

import torch
import torch.nn.functional as F


def run(q, k, v, qo_indptr, kv_indptr, sm_scale):
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    bounds = torch.stack([qo_indptr, kv_indptr]).tolist()
    for b in range(len(bounds[0]) - 1):
        q0, q1, k0, k1 = bounds[0][b], bounds[0][b + 1], bounds[1][b], bounds[1][b + 1]
        qb = q[q0:q1].transpose(0, 1)
        kb = k[k0:k1].repeat_interleave(group, dim=1).transpose(0, 1)
        vb = v[k0:k1].repeat_interleave(group, dim=1).transpose(0, 1)
        out[q0:q1] = F.scaled_dot_product_attention(qb, kb, vb, scale=sm_scale).transpose(0, 1)
    return out
