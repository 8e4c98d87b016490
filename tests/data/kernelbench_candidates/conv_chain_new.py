import torch
import torch.nn as nn
import torch.nn.functional as F


class ModelNew(nn.Module):
    """KernelBench-style candidate: the conv + ReLU + GroupNorm + scale chain, with ReLU and the
    scale fused into the normalisation by hand (same parameter names as the task's Model)."""

    def __init__(self, in_channels, out_channels, kernel_size, num_groups, scale_shape):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.group_norm = nn.GroupNorm(num_groups, out_channels)
        self.scale = nn.Parameter(torch.ones(scale_shape))
        self.num_groups = num_groups

    def forward(self, x):
        y = F.conv2d(x, self.conv.weight, self.conv.bias).clamp_min_(0)
        n, c, h, w = y.shape
        g = y.view(n, self.num_groups, -1)
        mean = g.mean(dim=-1, keepdim=True)
        var = g.var(dim=-1, unbiased=False, keepdim=True)
        g = (g - mean) * torch.rsqrt(var + self.group_norm.eps)
        y = g.view(n, c, h, w)
        return y * (self.group_norm.weight * self.scale.view(-1)).view(1, c, 1, 1) \
            + (self.group_norm.bias * self.scale.view(-1)).view(1, c, 1, 1)
