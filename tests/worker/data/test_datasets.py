"""Datasets → tensors at the architecture's input, through torchvision's real classes."""

from __future__ import annotations

import contextlib
import io
import logging
import threading
import time
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from PIL import Image

from core.archives import extract_image_folder
from core.zip_safety import ArchiveLimits
from tests.datagen import (
    CIFAR_CLASSES,
    SHAPE_CLASSES,
    one_by_one,
    shapes_zip,
    write_cifar10,
    write_mnist,
    write_photo_set,
)
from worker.data.dataset_decode import DecodedFiles, decode_files
from worker.data.datasets import CacheWriter, DatasetUnavailable, load_fake, load_image_folder, load_torchvision, split
from worker.data.image_array import TRANSFORM_VERSION, InputSpec

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


# ---------------------------------------------------------------------------- an uploaded set, decoded once


def test_a_set_decoded_by_the_pool_is_each_file_through_the_transform(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "datasets" / "ds1"
    files = write_photo_set(root, per_class=20)
    (root / "a" / "0005.jpg").write_bytes(files[5].read_bytes()[:2000])  # truncated
    (root / "b" / "notes.txt").write_text("not an image")
    readable = [f for f in files if f.name != "0005.jpg" or f.parent.name != "a"]
    cache = root.parent / ".ds1.cache"
    cache.mkdir()
    torch.save({"images": torch.zeros(1, 3, 32, 32, dtype=torch.uint8), "labels": torch.zeros(1),
                "classes": ["stale"]}, cache / "3x32x32.pt")  # written by the transform before the draft

    with caplog.at_level(logging.WARNING, logger="worker.data.dataset_decode"):
        data = load_image_folder(root, 3, 32, 32)
    assert np.array_equal(data.images.numpy(), one_by_one(readable, 3, 32, 32))
    assert data.labels.tolist() == [0] * 19 + [1] * 20 and data.classes == ["a", "b"]
    skipped = sorted(r.getMessage().split(":")[0] for r in caplog.records)
    assert skipped == [f"skipping unreadable image {root / 'a' / '0005.jpg'}",
                       f"skipping unreadable image {root / 'b' / 'notes.txt'}"]
    CacheWriter.wait()  # the job does not wait for its cache; the test does
    assert sorted(p.name for p in cache.glob("*.pt")) == [f"3x32x32-t{TRANSFORM_VERSION}.pt"]  # the stale cache is gone
    again = load_image_folder(root, 3, 32, 32)
    assert torch.equal(again.images, data.images) and torch.equal(again.labels, data.labels)


def test_decoding_a_set_holds_its_images_once(tmp_path: Path) -> None:
    """Peak memory of the decode (numpy's allocations, traced): the set's array, plus the chunks in
    flight; never a list of every image and then its stacked copy."""
    root = tmp_path / "ds"
    rng = np.random.default_rng(0)
    for label in ("a", "b"):
        (root / label).mkdir(parents=True)
        for i in range(1000):
            Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(root / label / f"{i}.png")
    tracemalloc.start()
    try:
        data = load_image_folder(root, 3, 64, 64)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    size = data.images.numel()
    assert data.images.shape == (2000, 3, 64, 64)
    assert peak < 1.5 * size, f"peak {peak / size:.2f}× the set"


def test_a_decoding_process_killed_mid_set_costs_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """SIGKILL one pool process while it decodes (as a decoder crash would end it): the pool
    breaks, nothing hangs, the chunks it held are decoded again and every file is in the set."""
    root = tmp_path / "ds"
    files = write_photo_set(root, per_class=120)
    me = psutil.Process()
    killed: list[int] = []
    # Pool processes are the forkserver's children, so our grandchildren; so are the decoding
    # processes other tests left running (/predict's share the forkserver): only a new one is ours.
    before = {p.pid for p in me.children(recursive=True)}

    def kill_a_decoder() -> None:
        deadline = time.monotonic() + 30
        while not killed and time.monotonic() < deadline:
            for process in me.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if process.pid not in before and process.ppid() != me.pid:
                        process.kill()
                        killed.append(process.pid)
                        return
            time.sleep(0.002)

    killer = threading.Thread(target=kill_a_decoder)
    killer.start()
    with caplog.at_level(logging.WARNING, logger="worker.data.dataset_decode"):
        data = load_image_folder(root, 3, 224, 224)
    killer.join()
    assert killed, "no decoding process was seen"
    assert any("a decoding process died" in r.getMessage() for r in caplog.records)
    assert not any(r.getMessage().startswith("skipping") for r in caplog.records)
    assert np.array_equal(data.images.numpy(), one_by_one(files, 3, 224, 224))


def test_a_pool_that_breaks_beside_a_stopped_process_does_not_hang(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """One decoding process SIGKILLed while the other is SIGSTOPped: the executor's own clean-up
    SIGTERMs the stopped one and waits for it for ever (a stopped process acts on nothing but
    SIGKILL and SIGCONT); the broken pool's processes are killed instead, and every file is in
    the set."""
    files = write_photo_set(tmp_path / "ds", per_class=60)
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    faults: list[str] = []

    def stop_one_kill_another() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(psutil.Error):
                new = [p for p in me.children(recursive=True) if p.pid not in before and p.ppid() != me.pid]
                if len(new) >= 2:
                    new[0].suspend()
                    faults.append("stopped")
                    new[1].kill()
                    faults.append("killed")
                    return
            time.sleep(0.002)

    decoded: list[DecodedFiles] = []
    fault = threading.Thread(target=stop_one_kill_another)
    decode = threading.Thread(target=lambda: decoded.append(decode_files(files, InputSpec(3, 64, 64), workers=2)),
                              daemon=True)
    with caplog.at_level(logging.WARNING, logger="worker.data.dataset_decode"):
        fault.start()
        decode.start()
        fault.join()
        decode.join(timeout=120)
    assert faults == ["stopped", "killed"], "two decoding processes were not seen"
    assert not decode.is_alive(), "the decode hung on its broken pool"
    assert any("a decoding process died" in r.getMessage() for r in caplog.records)
    assert np.array_equal(decoded[0].images, one_by_one(files, 3, 64, 64))
