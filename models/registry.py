"""Architectures by name, each with the input it expects. The one place a model name resolves."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from torch import nn

from models.catdog_net import CatDogNet
from models.cifar_net import CifarNet
from models.pretrained import PretrainedWeights, torchvision_default
from models.torchvision_nets import mobilenet_v3_small, resnet18


@dataclass(frozen=True)
class InputSpec:
    channels: int
    height: int
    width: int
    fixed_size: bool  # the network's fc layers depend on this exact size


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    input: InputSpec
    build: Callable[[int, int], nn.Module]  # (num_classes, in_channels) -> module
    # The classifier head: the module (attribute path, e.g. "classifier.3") whose output size is
    # num_classes. Fine-tuning on other classes re-initialises it and keeps the rest.
    head: str
    pretrained: PretrainedWeights | None = None  # torchvision's ImageNet weights, when it has them

    def parameters(self, num_classes: int = 10) -> int:
        return _parameter_count(self.name, num_classes)


class UnknownModel(KeyError):
    pass


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            "cifar_net",
            "The PyTorch CIFAR-10 tutorial net: conv 3→6→16 (5×5), max-pool, fc 120→84→classes.",
            InputSpec(3, 32, 32, fixed_size=True),
            lambda n, c: CifarNet(num_classes=n, in_channels=c),
            head="fc3",
        ),
        ModelSpec(
            "catdog_net",
            "The cats-vs-dogs tutorial net: three 5×5 convs 32/64/128 with 2×2 max-pool, fc 512→classes, grayscale.",
            InputSpec(1, 50, 50, fixed_size=True),
            lambda n, c: CatDogNet(num_classes=n, in_channels=c),
            head="fc2",
        ),
        ModelSpec(
            "resnet18",
            "torchvision ResNet-18, classes and channels fitted to the dataset; ImageNet weights with "
            "pretrained=true.",
            InputSpec(3, 32, 32, fixed_size=False),
            resnet18,
            head="fc",
            pretrained=torchvision_default("ResNet18_Weights"),
        ),
        ModelSpec(
            "mobilenet_v3_small",
            "torchvision MobileNetV3-Small, classes and channels fitted to the dataset; ImageNet weights with "
            "pretrained=true.",
            InputSpec(3, 32, 32, fixed_size=False),
            mobilenet_v3_small,
            head="classifier.3",
            pretrained=torchvision_default("MobileNet_V3_Small_Weights"),
        ),
    )
}


def get_model_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise UnknownModel(name) from None


def build_model(name: str, num_classes: int, in_channels: int | None = None) -> nn.Module:
    spec = get_model_spec(name)
    return spec.build(num_classes, in_channels if in_channels is not None else spec.input.channels)


def head_module(model: nn.Module, architecture: str) -> nn.Module:
    """The classifier head of a built `architecture` (ModelSpec.head)."""
    return model.get_submodule(get_model_spec(architecture).head)


@cache
def _parameter_count(name: str, num_classes: int) -> int:
    return sum(p.numel() for p in build_model(name, num_classes).parameters())
