"""RMSNorm and fused add + RMSNorm in PyTorch (fp32 math, bf16 out)."""

import torch

EPS = "@EPS@"  # filled per definition by pack.py


@torch.no_grad()
def rmsnorm(hidden_states, weight):
    x = hidden_states.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()
    return y.to(hidden_states.dtype)


@torch.no_grad()
def fused_add_rmsnorm(hidden_states, residual, weight):
    x = hidden_states.float() + residual.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()
    return y.to(hidden_states.dtype)
