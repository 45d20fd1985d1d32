"""An upload's first decode with the device path on (worker/data/device_dataset_decode.py), through
load_image_folder: run on the CPU twin (`DeviceDecode(device="cpu")`: torchvision's decode_jpeg and
resize take the CPU the same way), and on a GPU (`gpu` marker: skipped where torch sees none). The
set is the pool's (Pillow's) within JPEG_TOLERANCE, files nvJPEG is not given go to the pool,
unreadable files are skipped as before, every nvJPEG call stays under its pixel budget, and the
cache written is the same set."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from core.config import Settings
from core.datasets import DatasetRecord
from tests.datagen import photo_jpeg
from tests.worker.serving.test_device_decode import crafted, reencode
from worker.data.datasets import CacheWriter, ImageTensors, load_dataset, load_image_folder
from worker.data.device_dataset_decode import DeviceDecode
from worker.data.image_array import JPEG_TOLERANCE_MAX, JPEG_TOLERANCE_MEAN

LIMIT = 40_000_000
PHOTO = 500 * 375  # the decoded pixels of one photo_jpeg


def header_and_garbage(seed: int = 1) -> bytes:
    """A real JPEG's headers (frame, tables, scan header), then random entropy data, then its end
    marker: nvJPEG is given it (the plan reads the header alone)."""
    photo = photo_jpeg(500, 375, seed=seed)
    scan = photo.index(b"\xff\xda")
    noise = np.random.default_rng(seed).integers(0, 255, 20_000, dtype=np.uint8).tobytes().replace(b"\xff", b"\x00")
    return photo[:scan + 14] + noise + b"\xff\xd9"


def write_set(root: Path, photos: int = 7) -> dict[str, int]:
    """Class `a`: baseline photos (colour and one grayscale); class `b`: every file nvJPEG must not
    be given or trusted with. The count of files nvJPEG's plan takes, and of the rest."""
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    for i in range(photos):
        (root / "a" / f"{i:02d}.jpg").write_bytes(photo_jpeg(500, 375, seed=i))
    (root / "a" / "gray.jpg").write_bytes(reencode(photo_jpeg(500, 375, seed=99), "L"))
    hostile = {**crafted(), "header and garbage": header_and_garbage()}
    for i, (name, data) in enumerate(hostile.items()):
        (root / "b" / f"{i:02d}-{name.replace(' ', '_')}.jpg").write_bytes(data)
    # planned: the photos, the grayscale one, and the two whose headers are whole (corrupt, header + garbage)
    return {"planned": photos + 3, "pool": len(hostile) - 2}


def twins(tmp_path: Path, spec: tuple[int, ...], device_decode: DeviceDecode, photos: int = 7,
          ) -> tuple[ImageTensors, ImageTensors, dict[str, int]]:
    """The same set decoded by the pool alone and with the device path (two copies: two caches)."""
    counts = write_set(tmp_path / "pool", photos)
    shutil.copytree(tmp_path / "pool", tmp_path / "device")
    by_pool = load_image_folder(tmp_path / "pool", *spec)
    by_device = load_image_folder(tmp_path / "device", *spec, device_decode=device_decode)
    CacheWriter.wait()
    return by_pool, by_device, counts


def assert_within_tolerance(device: torch.Tensor, pool: torch.Tensor) -> None:
    assert device.shape == pool.shape and device.dtype == torch.uint8
    difference = (device.int() - pool.int()).abs()
    assert difference.max().item() <= JPEG_TOLERANCE_MAX, difference.max().item()
    assert difference.float().mean().item() <= JPEG_TOLERANCE_MEAN


@pytest.mark.parametrize("spec", [(3, 224, 224), (3, 224, 224, 256), (1, 224, 224)],
                         ids=["resize", "shorter side and crop", "gray"])
def test_a_set_decodes_with_the_device_path_as_the_pool_decodes_it(tmp_path: Path, spec: tuple[int, ...],
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Baseline photos go to the device decoder, the rest to the pool; the same files are kept,
    with the same labels, and every row is the pool's within JPEG_TOLERANCE. Unreadable files
    (truncated, a crafted size, not an image) are skipped with their warning, as before."""
    with caplog.at_level(logging.WARNING, logger="worker.data.dataset_decode"):
        by_pool, by_device, counts = twins(tmp_path, spec, DeviceDecode("cpu", LIMIT, 10**9))
    assert by_device.report is not None and by_pool.report is not None
    assert (by_device.report.on_device, by_device.report.on_cpu) == (counts["planned"], counts["pool"])
    assert (by_pool.report.on_device, by_pool.report.on_cpu) == (0, counts["planned"] + counts["pool"])
    assert by_device.classes == by_pool.classes == ["a", "b"]
    assert torch.equal(by_device.labels, by_pool.labels)
    skipped = sorted(Path(message.split("skipping unreadable image ")[1].split(": ")[0]).name
                     for message in (r.getMessage() for r in caplog.records)
                     if message.startswith(f"skipping unreadable image {tmp_path / 'device'}"))
    assert skipped == ["02-truncated.jpg", "04-bomb.jpg", "05-not_an_image.jpg"]
    assert len(by_device.labels) == counts["planned"] + counts["pool"] - 3
    assert_within_tolerance(by_device.images, by_pool.images)


def test_every_device_call_stays_under_its_pixel_budget(tmp_path: Path) -> None:
    """The batch plan, by the headers: at most `batch_pixels` decoded pixels per nvJPEG call; an
    image larger than the budget alone in its call."""
    _, by_device, counts = twins(tmp_path, (3, 224, 224), DeviceDecode("cpu", LIMIT, 2 * PHOTO))
    assert by_device.report is not None
    batches = by_device.report.device_batches
    assert sum(batches) == counts["planned"] * PHOTO and max(batches) <= 2 * PHOTO
    assert batches == (2 * PHOTO,) * 5  # 7 photos, the grayscale one, the corrupt and the garbage: 10 in 5 calls
    _, alone, _ = twins(tmp_path / "small", (3, 224, 224), DeviceDecode("cpu", LIMIT, PHOTO // 2))
    assert alone.report is not None and alone.report.device_batches == (PHOTO,) * counts["planned"]


def test_the_cache_the_device_path_writes_is_the_set_it_returned(tmp_path: Path) -> None:
    """The cache (read by the next job) holds the rows the first job trained on, the pool's shape
    and labels; reading it decodes nothing."""
    by_pool, by_device, _ = twins(tmp_path, (3, 224, 224), DeviceDecode("cpu", LIMIT, 10**9))
    again = load_image_folder(tmp_path / "device", 3, 224, 224, device_decode=DeviceDecode("cpu", LIMIT, 10**9))
    assert again.report is None  # from the cache
    assert torch.equal(again.images, by_device.images) and torch.equal(again.labels, by_pool.labels)
    assert again.images.shape == by_pool.images.shape and again.classes == by_pool.classes


def test_the_decode_setting_chooses_the_device_path_for_a_cuda_worker_only(tmp_path: Path) -> None:
    """TORCHYARD_DECODE and the job's device, as /predict reads them; a CPU worker's job decodes by
    the pool alone (load_dataset, as the train and evaluate handlers call it)."""
    chosen = DeviceDecode.chosen(Settings(decode="auto", decode_batch_pixels=123, max_image_pixels=456), "cuda:0")
    assert chosen == DeviceDecode("cuda:0", 456, 123)
    assert DeviceDecode.chosen(Settings(decode="cuda"), "cuda") is not None
    assert DeviceDecode.chosen(Settings(decode="cpu"), "cuda") is None
    assert DeviceDecode.chosen(Settings(decode="cuda"), "cpu") is None
    assert DeviceDecode.chosen(Settings(decode="auto"), None) is None
    settings = Settings(data_dir=tmp_path, decode="cuda")
    write_set(settings.datasets_dir / "ds1", photos=2)
    data = load_dataset(DatasetRecord(id="ds1", name="ds1", kind="upload"), settings, 3, 64, 64, device="cpu")
    assert data.report is not None and data.report.on_device == 0
    CacheWriter.wait()


@pytest.mark.gpu
def test_on_a_gpu_a_set_with_hostile_files_decodes_and_the_device_stays_in_service(tmp_path: Path) -> None:
    """nvJPEG on the GPU: the photos decode there, within JPEG_TOLERANCE of the pool's rows (a crafted
    file it is given decodes to garbage or goes to the pool); the device memory the decode takes is
    bounded by its budget; afterwards the device still computes (no sticky error)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    by_pool, by_device, counts = twins(tmp_path, (3, 224, 224), DeviceDecode("cuda", LIMIT, 4 * PHOTO), photos=16)
    peak = torch.cuda.max_memory_allocated() - before
    assert by_device.report is not None and by_device.report.on_device >= counts["planned"] - 2  # but the crafted two
    assert max(by_device.report.device_batches) <= 4 * PHOTO
    assert peak < 64 * 2**20, f"the decode held {peak / 2**20:.0f} MiB of device memory"
    assert torch.equal(by_device.labels[:17], by_pool.labels[:17])
    assert_within_tolerance(by_device.images[:17], by_pool.images[:17])
    conv = torch.nn.Conv2d(3, 8, 3).cuda()
    with torch.inference_mode():
        out = conv(by_device.images[:4].cuda().float() / 255)
    torch.cuda.synchronize()
    assert out.shape == (4, 8, 222, 222) and torch.isfinite(out).all().item()
