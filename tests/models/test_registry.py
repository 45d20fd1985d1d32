import pytest
import torch

from models.registry import MODELS, UnknownModel, build_model, get_model_spec


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


def test_parameter_counts_are_real() -> None:
    assert get_model_spec("cifar_net").parameters() == 62006  # the tutorial's count
    assert get_model_spec("resnet18").parameters() > 11_000_000
