import torch
import torch.nn as nn


class Model(nn.Module):
    """Level-2 style task: Conv2d, ReLU, GroupNorm, then a scaling by a learned per-channel factor."""

    def __init__(self, in_channels, out_channels, kernel_size, num_groups, scale_shape):
        super(Model, self).__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.group_norm = nn.GroupNorm(num_groups, out_channels)
        self.scale = nn.Parameter(torch.randn(scale_shape))

    def forward(self, x):
        x = self.conv(x)
        x = torch.relu(x)
        x = self.group_norm(x)
        return x * self.scale


batch_size = 2
in_channels = 3
out_channels = 8
height, width = 12, 12
kernel_size = 3
num_groups = 4
scale_shape = (out_channels, 1, 1)


def get_inputs():
    return [torch.randn(batch_size, in_channels, height, width)]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size, num_groups, scale_shape]
