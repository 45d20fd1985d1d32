"""A training job's resolution (core/kinds/train/resolution.py): the architecture looked up once, the
input it is loaded at, what a child of another job inherits, and the refusals that say why."""

from __future__ import annotations

import pytest

from core.errors import InvalidInput
from core.kinds.train import JobSpec, resolve_params
from core.kinds.train.resolution import known_model
from models.registry import MODELS
from tests.core.kinds.examples import train_params


def _spec(**fields) -> JobSpec:
    return JobSpec(**{"model": "resnet18", "dataset": "fake", **fields})


def test_an_unknown_model_is_refused_naming_the_others() -> None:
    assert known_model("resnet18") is MODELS["resnet18"]
    with pytest.raises(InvalidInput, match="unknown model 'resnet19'; available: cifar_net, catdog_net, resnet18"):
        known_model("resnet19")
    with pytest.raises(InvalidInput, match="unknown model"):
        resolve_params(_spec(model="resnet19"))


def test_the_input_is_resolved_at_submit() -> None:
    assert resolve_params(_spec(image_size=64)).input_for("resnet18") == (3, 64, 64)
    fixed = resolve_params(_spec(model="catdog_net"))
    assert (fixed.channels, fixed.height, fixed.width, fixed.image_size) == (1, 50, 50, 50)
    with pytest.raises(InvalidInput, match="takes 32×32 input only"):
        resolve_params(_spec(model="cifar_net", image_size=64))
    pretrained = resolve_params(_spec(pretrained=True))
    assert (pretrained.image_size, pretrained.resize_size) == (224, 256)  # ImageNet's crop and resize


def test_a_child_keeps_its_parents_size_and_resize_ratio() -> None:
    parent = resolve_params(_spec(pretrained=True, image_size=112))
    assert (parent.image_size, parent.resize_size) == (112, 128)
    child = resolve_params(_spec(init_from="parent"), MODELS["resnet18"], parent)
    assert (child.image_size, child.resize_size, child.pretrained) == (112, 128, False)
    larger = resolve_params(_spec(init_from="parent", image_size=224), MODELS["resnet18"], parent)
    assert larger.resize_size == 256  # the parent's ratio at the child's own size
    plain = resolve_params(_spec(init_from="parent"), MODELS["resnet18"], train_params(model="resnet18", image_size=40))
    assert (plain.image_size, plain.resize_size) == (40, None)


def test_starting_weights_that_cannot_be_are_refused() -> None:
    with pytest.raises(InvalidInput, match="give either init_from or pretrained"):
        resolve_params(_spec(pretrained=True, init_from="parent"))
    with pytest.raises(InvalidInput, match="cifar_net has no pretrained weights; pretrained works with resnet18"):
        resolve_params(_spec(model="cifar_net", pretrained=True))


def test_a_gangs_batch_is_the_global_batch_and_must_divide() -> None:
    with pytest.raises(InvalidInput, match="must divide by world_size"):
        resolve_params(_spec(batch_size=65, world_size=2))
    with pytest.raises(InvalidInput, match="give batch_size"):
        resolve_params(_spec(world_size=3))  # the defaults (256, 128) do not divide by 3
    assert resolve_params(_spec(world_size=4)).batch_size is None  # they divide by 4: left to the device
    assert resolve_params(_spec(batch_size=66, world_size=3)).batch_size == 66
