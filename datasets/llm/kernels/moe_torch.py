"""Fused MoE in PyTorch: route (top-k, renormalise), sort token slots by expert, one GEMM pair per expert.

bf16: fp32 math with an fp32 intermediate. int8 w8a8: exact integer GEMMs (fp64 on the CPU,
torch._int_mm on the GPU), per-token / per-channel scales, the SwiGLU output re-quantised per token.
"""

import torch
import torch.nn.functional as F


def _route(routing_logits, top_k):
    top_logits, top_ids = torch.topk(routing_logits.float(), top_k, dim=-1)
    return top_ids, torch.softmax(top_logits, dim=-1)


def _by_expert(top_ids):
    """Slots (token * top_k + slot) sorted by expert, and each expert's [start, end) in that order."""
    flat = top_ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=int(flat.max()) + 1 if flat.numel() else 1).tolist()
    bounds, acc = [], 0
    for c in counts:
        bounds.append((acc, acc + c))
        acc += c
    return order, bounds


def _int_matmul(a, b_t):
    """Exact int8 x int8 -> int32 product, a [n, k] @ b_t [k, m]."""
    if a.is_cuda and a.shape[0] > 16:
        return torch._int_mm(a, b_t.contiguous())
    return (a.double() @ b_t.double()).to(torch.int32)


@torch.no_grad()
def moe_bf16(hidden_states, routing_logits, gemm1_weights, gemm2_weights):
    T, H = hidden_states.shape
    E, two_i, _ = gemm1_weights.shape
    I = two_i // 2
    top_k = _TOP_K
    top_ids, top_w = _route(routing_logits, top_k)
    order, bounds = _by_expert(top_ids)
    out = torch.zeros(T * top_k, H, dtype=torch.float32, device=hidden_states.device)
    x = hidden_states.float()
    for e, (s, t) in enumerate(bounds):
        if s == t:
            continue
        slots = order[s:t]
        g1 = x[slots // top_k] @ gemm1_weights[e].float().T
        act = F.silu(g1[:, I:]) * g1[:, :I]
        out[slots] = act @ gemm2_weights[e].float().T
    out = out.view(T, top_k, H) * top_w[..., None]
    return out.sum(1).to(torch.bfloat16)


@torch.no_grad()
def moe_int8(hidden_states, hidden_states_scale, routing_logits, gemm1_weights, gemm1_weights_scale,
             gemm2_weights, gemm2_weights_scale):
    T, H = hidden_states.shape
    E, two_i, _ = gemm1_weights.shape
    I = two_i // 2
    top_k = _TOP_K
    top_ids, top_w = _route(routing_logits, top_k)
    order, bounds = _by_expert(top_ids)
    out = torch.zeros(T * top_k, H, dtype=torch.float32, device=hidden_states.device)
    for e, (s, t) in enumerate(bounds):
        if s == t:
            continue
        slots = order[s:t]
        tok = slots // top_k
        acc1 = _int_matmul(hidden_states[tok], gemm1_weights[e].T).float()
        g1 = acc1 * hidden_states_scale[tok, None] * gemm1_weights_scale[e][None, :]
        act = F.silu(g1[:, I:]) * g1[:, :I]
        scale = act.abs().amax(-1, keepdim=True).clamp_min(1e-10) / 127.0
        act_q = torch.round(act / scale).clamp_(-127, 127).to(torch.int8)
        acc2 = _int_matmul(act_q, gemm2_weights[e].T).float()
        out[slots] = acc2 * scale * gemm2_weights_scale[e][None, :]
    out = out.view(T, top_k, H) * top_w[..., None]
    return out.sum(1).to(torch.bfloat16)


_TOP_K = "@TOP_K@"  # filled per definition by pack.py
