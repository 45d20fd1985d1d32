"""Architectures by name, each with the input it expects. The one place a model name resolves.

Importing this module imports neither torch nor torchvision: the API validates model names,
sizes jobs and lists `GET /models` from it, and its processes stay light (importing torch and
torchvision takes an API process several times longer to start and an order of magnitude more
memory; the figures: docs/benchmarks.md, "Figures that were quoted in code comments"). A network
is built, and torch imported, only by `build_model`, in the worker; torchvision loads at the first
torchvision network or dataset a worker uses (once per process), not when it starts. What the API needs of a network without
building it (its parameter count, the activations it saves per image, its pretrained weights' file
and preprocessing) is written here, as torchvision writes `num_params` in its weights' metadata,
and tests/models/test_registry.py checks each figure against the built network, a meta-device
trace and torchvision's own enums.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from models.pretrained import PretrainedWeights

if TYPE_CHECKING:
    from torch import nn

# Pretrained weights' normalisation: the ImageNet statistics of torchvision's eval transforms.
_IMAGENET_MEAN = (0.485, 0.456, 0.406)
_IMAGENET_STD = (0.229, 0.224, 0.225)


def _cifar_net(num_classes: int, in_channels: int) -> nn.Module:
    from models.cifar_net import CifarNet

    return CifarNet(num_classes=num_classes, in_channels=in_channels)


def _catdog_net(num_classes: int, in_channels: int) -> nn.Module:
    from models.catdog_net import CatDogNet

    return CatDogNet(num_classes=num_classes, in_channels=in_channels)


def _resnet18(num_classes: int, in_channels: int) -> nn.Module:
    from models.torchvision_nets import resnet18

    return resnet18(num_classes, in_channels)


def _mobilenet_v3_small(num_classes: int, in_channels: int) -> nn.Module:
    from models.torchvision_nets import mobilenet_v3_small

    return mobilenet_v3_small(num_classes, in_channels)


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
    # Parameters of the network built for 10 classes and `input.channels` (what GET /models lists
    # and job admission sizes a job's model and optimiser state by).
    parameters: int
    # Bytes autograd saves per image in a training forward (10 classes, `input.channels`): at the
    # input size and, for a resizable network, at twice it (job admission interpolates between them,
    # core/admission.py). Traced on the meta device by `trace_activation_bytes`.
    activation_bytes: tuple[float, ...]
    # The classifier head: the module (attribute path, e.g. "classifier.3") whose output size is
    # num_classes. Fine-tuning on other classes re-initialises it and keeps the rest.
    head: str
    pretrained: PretrainedWeights | None = None  # torchvision's ImageNet weights, when it has them


class UnknownModel(KeyError):
    pass


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            "cifar_net",
            "The PyTorch CIFAR-10 tutorial net: conv 3→6→16 (5×5), max-pool, fc 120→84→classes.",
            InputSpec(3, 32, 32, fixed_size=True),
            _cifar_net,
            parameters=62_006,  # the tutorial's count
            activation_bytes=(83_264.0,),
            head="fc3",
        ),
        ModelSpec(
            "catdog_net",
            "The cats-vs-dogs tutorial net: three 5×5 convs 32/64/128 with 2×2 max-pool, fc 512→classes, grayscale.",
            InputSpec(1, 50, 50, fixed_size=True),
            _catdog_net,
            parameters=524_810,
            activation_bytes=(1_037_712.0,),
            head="fc2",
        ),
        ModelSpec(
            "resnet18",
            "torchvision ResNet-18, classes and channels fitted to the dataset; ImageNet weights with "
            "pretrained=true.",
            InputSpec(3, 32, 32, fixed_size=False),
            _resnet18,
            parameters=11_181_642,
            activation_bytes=(669_696.0, 2_672_640.0),
            head="fc",
            pretrained=PretrainedWeights(
                "ResNet18_Weights", "IMAGENET1K_V1", "https://download.pytorch.org/models/resnet18-f37072fd.pth",
                crop_size=224, resize_size=256, mean=_IMAGENET_MEAN, std=_IMAGENET_STD),
        ),
        ModelSpec(
            "mobilenet_v3_small",
            "torchvision MobileNetV3-Small, classes and channels fitted to the dataset; ImageNet weights with "
            "pretrained=true.",
            InputSpec(3, 32, 32, fixed_size=False),
            _mobilenet_v3_small,
            parameters=1_528_106,
            activation_bytes=(414_368.0, 1_516_832.0),
            head="classifier.3",
            pretrained=PretrainedWeights(
                "MobileNet_V3_Small_Weights", "IMAGENET1K_V1",
                "https://download.pytorch.org/models/mobilenet_v3_small-047dcff4.pth",
                crop_size=224, resize_size=256, mean=_IMAGENET_MEAN, std=_IMAGENET_STD),
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


def trace_activation_bytes(name: str, height: int, width: int) -> float:
    """What autograd saves per image in a training forward of `name` at height×width, traced on the
    meta device (shapes only: no memory, no data), at two batch sizes so the weights autograd also
    saves cancel out. Too slow to run per request (a full trace of the network), so the figures are
    written out in ModelSpec.activation_bytes, whose source this is."""
    import torch

    spec = get_model_spec(name)
    with torch.device("meta"):
        net = build_model(name, 10)
    net.train()

    def saved(batch: int) -> int:
        total = 0

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal total
            total += tensor.numel() * tensor.element_size()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            net(torch.empty(batch, spec.input.channels, height, width, device="meta"))
        return total

    return max(0.0, (saved(4) - saved(2)) / 2)
