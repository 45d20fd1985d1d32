"""Datasets → tensors at the architecture's input, through torchvision's real classes."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import tracemalloc
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import numpy as np
import psutil
import pytest
import torch
from PIL import Image

from core.archives import extract_image_folder
from core.zip_safety import ArchiveLimits
from tests.datagen import CIFAR_CLASSES, SHAPE_CLASSES, photo_jpeg, shapes_zip, write_cifar10, write_mnist
from worker.data import CacheWriter, DatasetUnavailable, load_fake, load_image_folder, load_torchvision, split
from worker.preprocess import image_to_array

REPO = Path(__file__).resolve().parents[2]

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


def write_photo_set(root: Path, per_class: int, size: tuple[int, int] = (500, 375)) -> list[Path]:
    """`<class>/<image>` of photo-like JPEGs, two classes; the files in the order a set lists them."""
    files = []
    for label in ("a", "b"):
        (root / label).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            path = root / label / f"{i:04d}.jpg"
            path.write_bytes(photo_jpeg(*size, seed=1000 * len(files) + i))
            files.append(path)
    return files


def one_by_one(files: list[Path], *spec: int | None) -> np.ndarray:
    """What the set's rows must be: each readable file through the one transform, in order."""
    arrays = []
    for path in files:
        with Image.open(path) as image:
            arrays.append(image_to_array(image, *spec))
    return np.stack(arrays)


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

    with caplog.at_level(logging.WARNING, logger="worker.dataset_decode"):
        data = load_image_folder(root, 3, 32, 32)
    assert np.array_equal(data.images.numpy(), one_by_one(readable, 3, 32, 32))
    assert data.labels.tolist() == [0] * 19 + [1] * 20 and data.classes == ["a", "b"]
    skipped = sorted(r.getMessage().split(":")[0] for r in caplog.records)
    assert skipped == [f"skipping unreadable image {root / 'a' / '0005.jpg'}",
                       f"skipping unreadable image {root / 'b' / 'notes.txt'}"]
    CacheWriter.wait()  # the job does not wait for its cache; the test does
    assert sorted(p.name for p in cache.glob("*.pt")) == ["3x32x32-t2.pt"]  # the stale cache is gone
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
    with caplog.at_level(logging.WARNING, logger="worker.dataset_decode"):
        data = load_image_folder(root, 3, 224, 224)
    killer.join()
    assert killed, "no decoding process was seen"
    assert any("a decoding process died" in r.getMessage() for r in caplog.records)
    assert not any(r.getMessage().startswith("skipping") for r in caplog.records)
    assert np.array_equal(data.images.numpy(), one_by_one(files, 3, 224, 224))


LOADER = r"""
import hashlib, logging, sys, time
from pathlib import Path
from worker.data import load_image_folder
if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s")
    data = load_image_folder(Path(sys.argv[1]), 3, 224, 224)
    print(hashlib.sha256(data.images.numpy().tobytes() + data.labels.numpy().tobytes()).hexdigest(), flush=True)
    if sys.argv[2:] == ["train"]:  # a job goes on with its data while its cache is written
        time.sleep(600)
"""


@pytest.fixture
def start_loader() -> Iterator[Callable[..., subprocess.Popen]]:
    """Start a worker's first job on a set, in a process of its own; any left at the end are killed
    (a failed test may leave one stopped)."""
    started: list[subprocess.Popen] = []

    def start(root: Path, *args: str) -> subprocess.Popen:
        started.append(subprocess.Popen([sys.executable, "-c", LOADER, str(root), *args], cwd=REPO,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        return started[-1]

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
            process.communicate()


def wait_for_line(stream: IO[str], text: str) -> None:
    for line in stream:
        if text in line:
            return
    raise AssertionError(f"the process ended without logging {text!r}")


def waits_for_a_lock(pid: int, timeout: float = 60) -> bool:
    """True once `pid` is blocked on a file lock (a `->` entry of /proc/locks: a waiter)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(line.split()[1] == "->" and line.split()[5] == str(pid) for line in Path("/proc/locks").read_text()
               .splitlines() if len(line.split()) > 5):
            return True
        time.sleep(0.05)
    return False


def decoding_processes(pid: int, timeout: float = 30) -> list[psutil.Process]:
    """`pid`'s descendants once its decode pool runs (the forkserver, and its children the pool)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        descendants = psutil.Process(pid).children(recursive=True)
        if any(p.ppid() != pid for p in descendants):
            return descendants
        time.sleep(0.01)
    raise AssertionError("the decode pool did not start")


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="reads the kernel's lock table (Linux)")
def test_two_workers_decode_a_set_once_and_a_killed_one_leaves_nothing(
        tmp_path: Path, start_loader: Callable[..., subprocess.Popen]) -> None:
    """Two first jobs on the same set and spec: the second waits for the first and reads its file
    (decoded once). A first job SIGKILLed while it decodes leaves no decoding process behind and no
    cache; the next one decodes the set itself."""
    root = tmp_path / "ds"
    files = write_photo_set(root, per_class=60)
    expected = one_by_one(files, 3, 224, 224)
    digest = hashlib.sha256(expected.tobytes() + np.repeat([0, 1], 60).astype(np.int64).tobytes()).hexdigest()

    first = start_loader(root)
    wait_for_line(first.stderr, "decoding 120 files")
    first.send_signal(signal.SIGSTOP)  # holding the lock, its cache not written
    second = start_loader(root)
    assert waits_for_a_lock(second.pid)
    first.send_signal(signal.SIGCONT)
    outputs = [process.communicate(timeout=120) for process in (first, second)]
    assert [out.strip() for out, _ in outputs] == [digest, digest]
    assert "decoding" not in outputs[1][1]  # the second read the first's file

    for cache in (root.parent / ".ds.cache").glob("*.pt"):
        cache.unlink()
    doomed = start_loader(root)
    wait_for_line(doomed.stderr, "decoding 120 files")
    decoders = decoding_processes(doomed.pid)
    doomed.kill()
    doomed.wait()
    _, alive = psutil.wait_procs(decoders, timeout=30)
    assert not alive, f"decoding processes outlived their worker: {alive}"
    assert not list((root.parent / ".ds.cache").glob("*.pt"))
    third = start_loader(root)
    out, err = third.communicate(timeout=120)
    assert out.strip() == digest and "decoding 120 files" in err


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="reads the kernel's lock table (Linux)")
def test_a_cache_unreadable_after_the_wait_fails_with_its_own_error(
        tmp_path: Path, start_loader: Callable[..., subprocess.Popen]) -> None:
    """A worker that waited for the spec's lock, then cannot read the file it finds (not a torch
    file), fails with that read's error: its lock's descriptor is closed once, not again after the
    read (which raised EBADF over the real error, or closed what another thread had opened since)."""
    root = tmp_path / "ds"
    write_photo_set(root, per_class=2)
    folder = tmp_path / ".ds.cache"
    folder.mkdir()
    holder = os.open(folder / "3x224x224.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another worker, decoding the set
    try:
        waiter = start_loader(root)
        assert waits_for_a_lock(waiter.pid)
        (folder / "3x224x224-t2.pt").write_bytes(b"not a torch file")
    finally:
        os.close(holder)
    _, err = waiter.communicate(timeout=60)
    assert waiter.returncode == 1 and "UnpicklingError" in err, err[-2000:]
    assert "Bad file descriptor" not in err and "During handling" not in err, err[-2000:]  # the one error


def test_a_cache_half_written_by_a_killed_worker_is_never_read(
        tmp_path: Path, start_loader: Callable[..., subprocess.Popen]) -> None:
    """A first job has its data before its cache is on disk (a thread writes it); SIGKILLed while the
    file is half-written, it leaves a temporary file and no cache: the next job decodes the set again,
    gets every image right, and removes the leftover."""
    root = tmp_path / "ds"
    files = write_photo_set(root, per_class=100)
    expected = one_by_one(files, 3, 224, 224)
    digest = hashlib.sha256(expected.tobytes() + np.repeat([0, 1], 100).astype(np.int64).tobytes()).hexdigest()
    folder = root.parent / ".ds.cache"
    cache = folder / "3x224x224-t2.pt"

    doomed = start_loader(root, "train")
    deadline = time.monotonic() + 120
    partial: list[Path] = []
    while not partial and doomed.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError):
            partial = [p for p in folder.glob(f".{cache.name}.*.tmp") if p.stat().st_size > 0]
    doomed.send_signal(signal.SIGSTOP)  # frozen mid-write, then killed where it stands
    assert partial, "the cache was never seen being written"
    written = partial[0].stat().st_size
    doomed.kill()
    doomed.communicate()
    assert not cache.exists(), "the kill landed after the rename: the file was whole; no half-written one to test"
    assert partial[0].exists() and written > 0  # a cache begun, under its temporary name only
    assert doomed.returncode == -signal.SIGKILL

    again = start_loader(root)
    out, err = again.communicate(timeout=120)
    assert out.strip() == digest and "decoding 200 files" in err  # decoded again, not read from the leftover
    assert cache.exists() and not list(folder.glob("*.tmp"))
    saved = torch.load(cache, weights_only=True)
    assert np.array_equal(saved["images"].numpy(), expected)


def test_a_set_deleted_while_its_cache_is_written_leaves_no_cache(tmp_path: Path) -> None:
    """The job has its images and may end, and its dataset be deleted (the source folder first),
    while the cache is still being written behind it: no decoded copy of a deleted set stays on disk."""
    root = tmp_path / "ds"
    for label in ("a", "b"):
        (root / label).mkdir(parents=True)
        for i in range(100):
            Image.new("RGB", (8, 8), (i, 2 * i, 255 - i)).save(root / label / f"{i}.png")
    data = load_image_folder(root, 3, 512, 512)  # ~150 MB to write: still writing when the set goes
    assert len(data.labels) == 200
    subprocess.run(["rm", "-rf", str(root)], check=True)
    CacheWriter.wait()
    assert not (tmp_path / ".ds.cache").exists()
    assert list(tmp_path.iterdir()) == []


def test_a_process_forked_while_the_cache_is_written_does_not_hold_the_sets_lock(tmp_path: Path) -> None:
    """A fork while the writer holds the spec's lock (a batch predict job's DataLoader forks its
    decoders): once the file is in place the lock is free for another worker, child alive or not."""
    root = tmp_path / "ds"
    for label in ("a", "b"):
        (root / label).mkdir(parents=True)
        for i in range(100):
            Image.new("RGB", (8, 8), (i, 2 * i, 255 - i)).save(root / label / f"{i}.png")
    load_image_folder(root, 3, 512, 512)  # ~150 MB to write: the writer holds the lock meanwhile
    child = os.fork()
    if child == 0:  # a forked decoder: alive well past the write
        time.sleep(30)
        os._exit(0)
    try:
        CacheWriter.wait()
        lock = tmp_path / ".ds.cache" / "3x512x512.lock"
        probe = subprocess.run([sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); "
                                "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)", str(lock)],
                               capture_output=True, text=True, timeout=30)
        assert probe.returncode == 0, probe.stderr
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
