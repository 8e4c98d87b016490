"""A Llama-style decoder block in plain PyTorch over packed (ragged) sequences.

RMSNorm -> fused QKV projection -> RoPE -> causal GQA attention -> O projection ->
residual -> RMSNorm -> fused gate/up projection -> SiLU-and-mul -> down projection ->
residual. Every heavy op goes through `Ops`, so fibray can trace and substitute it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from examples.llama_block.ops import Ops, make_ops

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class BlockConfig:
    """Shape of the block."""

    hidden: int = 128
    heads: int = 2
    kv_heads: int = 1
    head_dim: int = 64
    intermediate: int = 256
    vocab: int = 1000
    dtype: str = "fp16"
    """fp16 | bf16 | fp32 (Triton's CPU interpreter mis-computes bf16 tl.dot, so CI uses fp16)."""
    rope_theta: float = 10000.0

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


CONFIGS = {
    "tiny": BlockConfig(),
    "llama3_8b": BlockConfig(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336,
                             vocab=128256, dtype="bf16", rope_theta=500000.0),
}


class DecoderBlock(nn.Module):
    """One decoder layer (plus a token embedding, so that it can be fed prompts)."""

    def __init__(self, config: BlockConfig, seed: int = 0) -> None:
        super().__init__()
        c = config
        self.config = c
        self.ops: Ops = make_ops(c.hidden, c.heads, c.kv_heads, c.head_dim, c.intermediate, c.torch_dtype)
        gen = torch.Generator().manual_seed(seed)

        def param(*shape: int, scale: float) -> nn.Parameter:
            return nn.Parameter((torch.randn(*shape, generator=gen) * scale).to(c.torch_dtype), requires_grad=False)

        self.embed = param(c.vocab, c.hidden, scale=1.0)
        self.attn_norm = param(c.hidden, scale=0.1)
        self.ffn_norm = param(c.hidden, scale=0.1)
        with torch.no_grad():
            self.attn_norm.add_(1.0)
            self.ffn_norm.add_(1.0)
        self.w_qkv = param((c.heads + 2 * c.kv_heads) * c.head_dim, c.hidden, scale=c.hidden ** -0.5)
        self.w_o = param(c.hidden, c.heads * c.head_dim, scale=(c.heads * c.head_dim) ** -0.5)
        self.w_gate_up = param(2 * c.intermediate, c.hidden, scale=c.hidden ** -0.5)
        self.w_down = param(c.hidden, c.intermediate, scale=c.intermediate ** -0.5)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        half = self.config.head_dim // 2
        freqs = self.config.rope_theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
        angles = positions.float()[:, None] * freqs[None, :]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def forward(self, tokens: torch.Tensor, indptr: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens, positions: [T] packed sequences; indptr: [batch + 1] int32 sequence bounds."""
        c, ops = self.config, self.ops
        x = self.embed[tokens]
        h = ops.attn_norm(x, self.attn_norm)
        qkv = ops.qkv_proj(h, self.w_qkv)
        q_size, kv_size = c.heads * c.head_dim, c.kv_heads * c.head_dim
        q = self._rope(qkv[:, :q_size].reshape(-1, c.heads, c.head_dim), positions)
        k = self._rope(qkv[:, q_size:q_size + kv_size].reshape(-1, c.kv_heads, c.head_dim), positions)
        v = qkv[:, q_size + kv_size:].reshape(-1, c.kv_heads, c.head_dim).contiguous()
        a = ops.attention(q, k, v, indptr, indptr, 1.0 / math.sqrt(c.head_dim))
        x = x + ops.o_proj(a.reshape(-1, q_size), self.w_o)
        h = ops.ffn_norm(x, self.ffn_norm)
        gate, up = ops.gate_up_proj(h, self.w_gate_up).chunk(2, dim=-1)
        return x + ops.down_proj(F.silu(gate) * up, self.w_down)


def pack_prompts(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, indptr, positions) of a batch of prompts packed back to back."""
    lengths = [len(p) for p in prompts]
    indptr = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    tokens = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])
    return tokens, indptr, positions


def sample_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    """Deterministic token ids for prompts of the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
