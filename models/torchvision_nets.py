"""torchvision architectures, built without pretrained weights and fitted to the dataset."""

from __future__ import annotations

from torch import nn
from torchvision import models as tvm


def resnet18(num_classes: int, in_channels: int = 3) -> nn.Module:
    """ResNet-18 with its stem adapted to `in_channels` (grayscale datasets) and `num_classes`."""
    net = tvm.resnet18(weights=None, num_classes=num_classes)
    if in_channels != 3:
        net.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return net


def mobilenet_v3_small(num_classes: int, in_channels: int = 3) -> nn.Module:
    """MobileNetV3-Small with its first conv adapted to `in_channels` and `num_classes`."""
    net = tvm.mobilenet_v3_small(weights=None, num_classes=num_classes)
    if in_channels != 3:
        first = net.features[0][0]
        net.features[0][0] = nn.Conv2d(
            in_channels, first.out_channels, first.kernel_size, first.stride, first.padding, bias=False
        )
    return net
