"""Datasets → tensors at the architecture's input, through torchvision's real classes."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest
import torch

from core.archives import extract_image_folder
from core.zip_safety import ArchiveLimits
from tests.datagen import CIFAR_CLASSES, SHAPE_CLASSES, shapes_zip, write_cifar10, write_mnist
from worker.data import DatasetUnavailable, load_fake, load_image_folder, load_torchvision, split

LIMITS = ArchiveLimits(max_entries=10_000, max_uncompressed_bytes=10**9, max_ratio=200.0, max_image_pixels=10**7)


def test_cifar10_through_torchvision_format(tmp_path: Path) -> None:
    write_cifar10(tmp_path, per_batch=20)
    data = load_torchvision("cifar10", tmp_path, 3, 32, 32, download=False, verify_checksums=False)
    assert data.images.shape == (100, 3, 32, 32) and data.images.dtype == torch.uint8
    assert data.classes == CIFAR_CLASSES and data.labels.tolist()[:12] == [*range(10), 0, 1]


def test_cifar10_checksums_are_checked_by_default(tmp_path: Path) -> None:
    """torchvision compares each file's md5 with the official archive's; generated files fail it."""
    write_cifar10(tmp_path, per_batch=10)
    with pytest.raises(DatasetUnavailable, match="corrupted"):
        load_torchvision("cifar10", tmp_path, 3, 32, 32, download=False)


def test_cifar10_missing_file_names_the_folder(tmp_path: Path) -> None:
    folder = write_cifar10(tmp_path, per_batch=10)
    (folder / "data_batch_3").unlink()
    with pytest.raises(DatasetUnavailable) as info:
        load_torchvision("cifar10", tmp_path, 3, 32, 32, download=False, verify_checksums=False)
    assert str(folder) in str(info.value) and "TORCHYARD_ALLOW_DOWNLOAD" in str(info.value)


def test_mnist_resized_and_three_channel(tmp_path: Path) -> None:
    write_mnist(tmp_path, train=30, test=10)
    gray = load_torchvision("mnist", tmp_path, 1, 50, 50, download=False)
    assert gray.images.shape == (30, 1, 50, 50) and len(gray.classes) == 10
    rgb = load_torchvision("mnist", tmp_path, 3, 32, 32, download=False)
    assert rgb.images.shape == (30, 3, 32, 32)
    assert torch.equal(rgb.images[:, 0], rgb.images[:, 1])  # gray → RGB repeats the channel


def test_fashion_mnist_missing(tmp_path: Path) -> None:
    with pytest.raises(DatasetUnavailable, match=str(tmp_path / "FashionMNIST" / "raw")):
        load_torchvision("fashion_mnist", tmp_path, 1, 28, 28, download=False)


def test_image_folder_skips_corrupt_and_converts(tmp_path: Path) -> None:
    dest = tmp_path / "datasets" / "ds1"
    extracted = extract_image_folder(io.BytesIO(shapes_zip(per_class=5)), dest, LIMITS)
    assert extracted.classes == list(SHAPE_CLASSES)
    assert [s.path for s in extracted.skipped] == ["shapes/circle/broken.png"]
    assert extracted.class_counts == dict.fromkeys(SHAPE_CLASSES, 5)

    gray = load_image_folder(dest, 1, 50, 50)  # catdog_net's input: grayscale 50×50
    assert gray.images.shape == (15, 1, 50, 50) and gray.classes == list(SHAPE_CLASSES)
    assert sorted(gray.labels.tolist()) == [0] * 5 + [1] * 5 + [2] * 5
    rgb = load_image_folder(dest, 3, 32, 32)
    assert rgb.images.shape == (15, 3, 32, 32)
    again = load_image_folder(dest, 3, 32, 32)  # from the per-spec cache
    assert torch.equal(again.images, rgb.images) and torch.equal(again.labels, rgb.labels)


def test_no_usable_class_is_refused(tmp_path: Path) -> None:
    from core.errors import InvalidInput

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("readme.txt", b"no folders here")
    with pytest.raises(InvalidInput):
        extract_image_folder(io.BytesIO(buffer.getvalue()), tmp_path / "d", LIMITS)
    assert not (tmp_path / "d").exists()


def test_split_is_seeded_and_disjoint() -> None:
    train, val = split(100, 0.2, seed=3)
    assert len(val) == 20 and len(train) == 80
    assert set(train.tolist()).isdisjoint(val.tolist()) and len(set(train.tolist()) | set(val.tolist())) == 100
    assert torch.equal(split(100, 0.2, seed=3)[1], val) and not torch.equal(split(100, 0.2, seed=4)[1], val)
    assert len(split(100, 0.0, seed=3)[1]) == 0


def test_fake_is_deterministic() -> None:
    a, b = load_fake(3, 32, 32, seed=1), load_fake(3, 32, 32, seed=1)
    assert torch.equal(a.images, b.images) and a.images.shape[1:] == (3, 32, 32)
