"""A model with a branch its forward never uses: DDP needs ddp.find_unused_parameters=true."""

from __future__ import annotations

import torch
from torch import nn


class UnusedBranch(nn.Module):
    def __init__(self, num_classes: int, in_channels: int, image_size: int) -> None:
        super().__init__()
        self.head = nn.Linear(in_channels * image_size * image_size, num_classes)
        self.unused = nn.Linear(4, 4)  # gets no gradient: DDP's reducer waits for it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x.flatten(1))


def unused_branch(num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    return UnusedBranch(num_classes, in_channels, image_size)
