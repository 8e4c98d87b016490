import torch
import torch.nn as nn


class Model(nn.Module):
    """Level-1 style task: a single square matrix multiplication C = A @ B."""

    def __init__(self):
        super(Model, self).__init__()

    def forward(self, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        return torch.matmul(A, B)


N = 64


def get_inputs():
    A = torch.randn(N, N)
    B = torch.randn(N, N)
    return [A, B]


def get_init_inputs():
    return []  # no special initialisation
