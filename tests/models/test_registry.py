import subprocess
import sys

import pytest
import torch

from models.pretrained import torchvision_default
from models.registry import MODELS, UnknownModel, build_model, get_model_spec, trace_activation_bytes
from tests.support import REPO


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("num_classes", [2, 10])
def test_models_map_their_input_to_class_logits(name: str, num_classes: int) -> None:
    spec = get_model_spec(name)
    model = build_model(name, num_classes).eval()
    x = torch.randn(3, spec.input.channels, spec.input.height, spec.input.width)
    with torch.inference_mode():
        assert model(x).shape == (3, num_classes)


def test_tutorial_architectures_keep_their_shapes() -> None:
    cifar = build_model("cifar_net", 10)
    assert get_model_spec("cifar_net").parameters == 62006  # the tutorial's count
    assert (cifar.conv1.in_channels, cifar.conv1.out_channels, cifar.conv2.out_channels) == (3, 6, 16)
    assert (cifar.fc1.in_features, cifar.fc1.out_features, cifar.fc2.out_features) == (400, 120, 84)
    catdog = build_model("catdog_net", 2)
    assert [catdog.conv1.out_channels, catdog.conv2.out_channels, catdog.conv3.out_channels] == [32, 64, 128]
    assert catdog.fc1.in_features == 512 and catdog.conv1.kernel_size == (5, 5)
    assert get_model_spec("catdog_net").input.channels == 1


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small"])
def test_torchvision_models_fit_grayscale_and_other_sizes(name: str) -> None:
    model = build_model(name, 7, in_channels=1).eval()
    with torch.inference_mode():
        assert model(torch.randn(2, 1, 48, 48)).shape == (2, 7)


def test_unknown_model() -> None:
    with pytest.raises(UnknownModel):
        get_model_spec("vgg99")


@pytest.mark.parametrize("name", list(MODELS))
def test_what_the_api_knows_without_torch_is_what_torch_builds(name: str) -> None:
    """The figures the registry writes out (so the API imports no torch) are the built network's,
    the meta-device traces' and torchvision's own weights metadata."""
    spec = get_model_spec(name)
    assert spec.parameters == sum(p.numel() for p in build_model(name, 10).parameters())
    sizes = [spec.input.height] if spec.input.fixed_size else [spec.input.height, 2 * spec.input.height]
    assert spec.activation_bytes == tuple(trace_activation_bytes(name, size, size) for size in sizes)
    if spec.pretrained is not None:
        assert spec.pretrained == torchvision_default(spec.pretrained.enum)


def test_the_api_imports_neither_torch_nor_torchvision() -> None:
    """An API process stays light: it starts in about a second and holds no torch (models/registry.py)."""
    script = "import sys, app.main, app.cli; print(sorted(m for m in ('torch', 'torchvision', 'numpy') if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]", loaded.stderr
