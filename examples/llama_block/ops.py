"""The block's kernels in plain PyTorch (the known-good fallbacks) and the contract names they answer to.

`make_ops(config)` wraps each fallback with `fibray.apply.apply` under the name of the
definition its shapes belong to, so tracing and dispatch see the same calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from fibray.apply import apply

DTYPE_TAGS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
EPS = 1e-5


def rmsnorm_name(hidden: int, dtype: torch.dtype) -> str:
    return f"rmsnorm_h{hidden}_{DTYPE_TAGS[dtype]}"


def gemm_name(n: int, k: int, dtype: torch.dtype) -> str:
    return f"gemm_n{n}_k{k}_{DTYPE_TAGS[dtype]}"


def attention_name(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> str:
    return f"gqa_ragged_causal_h{heads}_kv{kv_heads}_d{head_dim}_{DTYPE_TAGS[dtype]}"


def rmsnorm(hidden_states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm in fp32, eps 1e-5."""
    x = hidden_states.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()).to(hidden_states.dtype)


def linear(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b.T with b laid out [out_features, in_features], as nn.Linear keeps it."""
    return a @ b.T


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qo_indptr: torch.Tensor,
              kv_indptr: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """Causal GQA over ragged sequences: sequence b holds rows indptr[b]:indptr[b+1]."""
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    bounds = torch.stack([qo_indptr, kv_indptr]).tolist()
    for b in range(len(bounds[0]) - 1):
        q0, q1, k0, k1 = bounds[0][b], bounds[0][b + 1], bounds[1][b], bounds[1][b + 1]
        qb = q[q0:q1].transpose(0, 1)
        kb = k[k0:k1].repeat_interleave(group, dim=1).transpose(0, 1)
        vb = v[k0:k1].repeat_interleave(group, dim=1).transpose(0, 1)
        mask = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=q.device).tril(k1 - k0 - (q1 - q0))
        ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=sm_scale)
        out[q0:q1] = ob.transpose(0, 1)
    return out


@dataclass(frozen=True)
class Ops:
    """The block's kernels, each routed through apply under its definition's name."""

    attn_norm: Callable[..., torch.Tensor]
    ffn_norm: Callable[..., torch.Tensor]
    qkv_proj: Callable[..., torch.Tensor]
    o_proj: Callable[..., torch.Tensor]
    gate_up_proj: Callable[..., torch.Tensor]
    down_proj: Callable[..., torch.Tensor]
    attention: Callable[..., torch.Tensor]


def make_ops(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, dtype: torch.dtype) -> Ops:
    """Decorated kernels for one block shape (fixed names: no resolver cost per call)."""
    norm = apply(rmsnorm_name(hidden, dtype))(rmsnorm)
    qkv = (heads + 2 * kv_heads) * head_dim
    return Ops(
        attn_norm=norm,
        ffn_norm=norm,
        qkv_proj=apply(gemm_name(qkv, hidden, dtype))(linear),
        o_proj=apply(gemm_name(hidden, heads * head_dim, dtype))(linear),
        gate_up_proj=apply(gemm_name(2 * intermediate, hidden, dtype))(linear),
        down_proj=apply(gemm_name(hidden, intermediate, dtype))(linear),
        attention=apply(attention_name(heads, kv_heads, head_dim, dtype))(attention),
    )
