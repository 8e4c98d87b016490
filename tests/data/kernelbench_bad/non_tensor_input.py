import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x, dim):
        return torch.sum(x, dim=dim)


def get_inputs():
    return [torch.randn(4, 8), 1]  # dim belongs in get_init_inputs


def get_init_inputs():
    return []
