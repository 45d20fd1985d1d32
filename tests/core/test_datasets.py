import torchvision.datasets as tvd

from core.datasets import builtin_classes


def test_builtin_class_names_are_torchvisions() -> None:
    """Written out in core/datasets.py so the API imports no torchvision; the worker reads the sets
    through torchvision, whose names a trained job's classes are."""
    assert builtin_classes("mnist") == tvd.MNIST.classes
    assert builtin_classes("fashion_mnist") == tvd.FashionMNIST.classes
