"""Fused MoE in Triton: a grouped GEMM over expert-sorted token slots (the vLLM / SGLang layout).

The host routes (top-k, renormalise) and aligns each expert's slots to BLOCK_M; kernel 1 computes
up and gate for one expert tile and applies SwiGLU; kernel 2 multiplies by the down projection
and the routing weight; the top_k rows of a token are summed at the end. The bf16 path keeps
the intermediate in fp32 and feeds it to the second GEMM as three bf16 parts (fp32 accuracy at
tensor-core speed: a bf16 intermediate misses the contract's tolerance where outputs cancel); the int8 path runs int8 x int8 -> int32 dots with per-token and
per-channel scales and re-quantises the intermediate per token (round half to even).
Destination-passing: the result is written into `output`.
"""

import torch
import triton
import triton.language as tl


def _route_and_align(routing_logits, top_k, block_m):
    """Routing weights [T*top_k], slot ids sorted by expert and padded per expert to BLOCK_M, expert of each block."""
    top_logits, top_ids = torch.topk(routing_logits.float(), top_k, dim=-1)
    weights = torch.softmax(top_logits, dim=-1).flatten()
    flat = top_ids.flatten()
    num_experts = routing_logits.shape[1]
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    total = int(padded.sum())
    sorted_ids = torch.full((total,), flat.numel(), dtype=torch.int32, device=flat.device)  # pad = one past the end
    sorted_expert = flat[order]
    rank = torch.arange(flat.numel(), device=flat.device) - (torch.cumsum(counts, 0) - counts)[sorted_expert]
    sorted_ids[starts[sorted_expert] + rank] = order.to(torch.int32)
    block_expert = torch.repeat_interleave(torch.arange(num_experts, device=flat.device, dtype=torch.int32),
                                           padded // block_m)
    return weights, sorted_ids, block_expert


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr):
    """tl.dot; on the CPU interpreter in fp32 (its bf16 dot multiplies raw bit patterns)."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        return tl.dot(a, b)


@triton.jit
def _gemm1_swiglu(x_ptr, xs_ptr, w_ptr, ws_ptr, sorted_ptr, block_expert_ptr, act_ptr, num_slots, H, I,
                  TOP_K: tl.constexpr, INT8: tl.constexpr, DOT_F32: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    slots = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    ok = slots < num_slots
    tok = (slots // TOP_K).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    kk = tl.arange(0, BLOCK_K)
    acc_dtype = tl.int32 if INT8 else tl.float32
    up = tl.zeros((BLOCK_M, BLOCK_N), acc_dtype)
    gate = tl.zeros((BLOCK_M, BLOCK_N), acc_dtype)
    w_base = w_ptr + e * 2 * I * H
    for k0 in range(0, H, BLOCK_K):
        k = k0 + kk
        x = tl.load(x_ptr + tok[:, None] * H + k[None, :], mask=ok[:, None] & (k[None, :] < H), other=0)
        w_up = tl.load(w_base + n[None, :].to(tl.int64) * H + k[:, None], mask=n_ok[None, :] & (k[:, None] < H), other=0)
        w_gate = tl.load(w_base + (I + n[None, :]).to(tl.int64) * H + k[:, None], mask=n_ok[None, :] & (k[:, None] < H), other=0)
        if INT8:
            up += tl.dot(x, w_up)
            gate += tl.dot(x, w_gate)
        else:
            up += _dot(x, w_up, DOT_F32)
            gate += _dot(x, w_gate, DOT_F32)
    up_f = up.to(tl.float32)
    gate_f = gate.to(tl.float32)
    if INT8:
        xs = tl.load(xs_ptr + tok, mask=ok, other=0.0)
        s_up = tl.load(ws_ptr + e * 2 * I + n, mask=n_ok, other=0.0)
        s_gate = tl.load(ws_ptr + e * 2 * I + I + n, mask=n_ok, other=0.0)
        up_f = up_f * xs[:, None] * s_up[None, :]
        gate_f = gate_f * xs[:, None] * s_gate[None, :]
    act = gate_f / (1.0 + tl.exp(-gate_f)) * up_f
    tl.store(act_ptr + slots[:, None].to(tl.int64) * I + n[None, :], act, mask=ok[:, None] & n_ok[None, :])


@triton.jit
def _quantize_rows(act_ptr, q_ptr, scale_ptr, I, BLOCK: tl.constexpr):
    """Per-row symmetric int8: scale = max|x| / 127, q = round-half-even(x / scale)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x = tl.load(act_ptr + row * I + offs, mask=offs < I, other=0.0)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-10) / 127.0
    y = x / scale
    r = tl.floor(y + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    r = tl.where(((r - y) == 0.5) & odd, r - 1.0, r)
    r = tl.minimum(tl.maximum(r, -127.0), 127.0)
    tl.store(q_ptr + row * I + offs, r.to(tl.int8), mask=offs < I)
    tl.store(scale_ptr + row, scale)


@triton.jit
def _gemm2(a_ptr, as_ptr, w_ptr, ws_ptr, sorted_ptr, block_expert_ptr, rw_ptr, out_ptr, num_slots, H, I,
           INT8: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    slots = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    ok = slots < num_slots
    rows = slots.to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < H
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.int32 if INT8 else tl.float32)
    w_base = w_ptr + e * H * I
    for k0 in range(0, I, BLOCK_K):
        k = k0 + kk
        a = tl.load(a_ptr + rows[:, None] * I + k[None, :], mask=ok[:, None] & (k[None, :] < I), other=0)
        w = tl.load(w_base + n[None, :].to(tl.int64) * I + k[:, None], mask=n_ok[None, :] & (k[:, None] < I), other=0)
        if INT8:
            acc += tl.dot(a, w)
        elif DOT_F32:
            acc += tl.dot(a, w.to(tl.float32))
        else:  # fp32 intermediate as three bf16 parts: three tensor-core dots, all 24 bits of mantissa
            hi = a.to(tl.bfloat16)
            rest = a - hi.to(tl.float32)
            mid = rest.to(tl.bfloat16)
            lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
            acc += tl.dot(hi, w) + tl.dot(mid, w) + tl.dot(lo, w)
    y = acc.to(tl.float32)
    if INT8:
        a_s = tl.load(as_ptr + rows, mask=ok, other=0.0)
        w_s = tl.load(ws_ptr + e * H + n, mask=n_ok, other=0.0)
        y = y * a_s[:, None] * w_s[None, :]
    y = y * tl.load(rw_ptr + rows, mask=ok, other=0.0)[:, None]
    tl.store(out_ptr + rows[:, None] * H + n[None, :], y, mask=ok[:, None] & n_ok[None, :])


def _tiles(device, tokens):
    if device.type == "cuda":
        return (16 if tokens <= 64 else 64), 64, 64, 4
    return 16, 256, 256, 4


def _moe(x, x_scale, routing_logits, w1, w1_scale, w2, w2_scale, output, int8):
    T, H = x.shape
    E, two_i, _ = w1.shape
    I = two_i // 2
    top_k = _TOP_K
    if T == 0:
        return
    bm, bn, bk, warps = _tiles(x.device, T)
    weights, sorted_ids, block_expert = _route_and_align(routing_logits, top_k, bm)
    slots = T * top_k
    dot_f32 = not x.is_cuda
    act = torch.empty(slots, I, dtype=torch.float32, device=x.device)
    _gemm1_swiglu[(block_expert.numel(), triton.cdiv(I, bn))](
        x, x_scale, w1, w1_scale, sorted_ids, block_expert, act, slots, H, I, TOP_K=top_k, INT8=int8,
        DOT_F32=dot_f32, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    if int8:
        a = torch.empty(slots, I, dtype=torch.int8, device=x.device)
        a_scale = torch.empty(slots, dtype=torch.float32, device=x.device)
        _quantize_rows[(slots,)](act, a, a_scale, I, BLOCK=triton.next_power_of_2(I))
    else:
        a, a_scale = act, act
    per_slot = torch.empty(slots, H, dtype=torch.float32, device=x.device)
    _gemm2[(block_expert.numel(), triton.cdiv(H, bn))](
        a, a_scale, w2, w2_scale, sorted_ids, block_expert, weights, per_slot, slots, H, I, INT8=int8,
        DOT_F32=dot_f32, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    output.copy_(per_slot.view(T, top_k, H).sum(dim=1))


def moe_bf16(hidden_states, routing_logits, gemm1_weights, gemm2_weights, output):
    _moe(hidden_states, hidden_states, routing_logits, gemm1_weights, hidden_states, gemm2_weights, hidden_states,
         output, int8=False)


def moe_int8(hidden_states, hidden_states_scale, routing_logits, gemm1_weights, gemm1_weights_scale,
             gemm2_weights, gemm2_weights_scale, output):
    _moe(hidden_states, hidden_states_scale, routing_logits, gemm1_weights, gemm1_weights_scale, gemm2_weights,
         gemm2_weights_scale, output, int8=True)


_TOP_K = "@TOP_K@"  # filled per definition by pack.py
