"""The three-conv network of the classic cats-vs-dogs tutorial (grayscale 50×50 input)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CatDogNet(nn.Module):
    """Three 5×5 convs (32, 64, 128), each ReLU + 2×2 max-pool, flatten (512) → fc 512 → classes.

    The original trained with MSE on softmax outputs; we return logits for cross-entropy.
    """

    def __init__(self, num_classes: int = 2, in_channels: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, 5)
        self.conv2 = nn.Conv2d(32, 64, 5)
        self.conv3 = nn.Conv2d(64, 128, 5)
        self.fc1 = nn.Linear(128 * 2 * 2, 512)
        self.fc2 = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.max_pool2d(F.relu(self.conv3(x)), 2)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        return self.fc2(x)
