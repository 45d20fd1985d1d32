"""/predict's JPEGs decoded on the device (worker/serving/device_decode.py): the selection, the
grouping under a pixel budget, and every fallback, run by its CPU twin (torchvision's decode_jpeg
takes device="cpu" the same way), plus the same checks on a GPU (`gpu` marker: skipped here) with
crafted files. Each image's row is the contract's (the CPU path's) within JPEG_TOLERANCE, and one
hostile file never costs its batch-mates their rows."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
import torch
from PIL import Image

from tests.datagen import photo_jpeg
from worker.data.image_array import JPEG_TOLERANCE_MAX, BadImage, InputSpec, decode_image
from worker.serving.device_decode import DeviceJpegDecoder, device_jpeg_plan

SPEC = InputSpec(3, 224, 224)
LIMIT = 40_000_000


def cpu_path(spec: InputSpec = SPEC):
    """The CPU path, counted: what the device decoder falls back to."""
    calls: list[bytes] = []

    def decode(blob: bytes) -> np.ndarray:
        calls.append(blob)
        return decode_image(blob, spec, LIMIT)

    return decode, calls


def reencode(data: bytes, mode: str = "RGB", **options: object) -> bytes:
    out = io.BytesIO()
    Image.open(io.BytesIO(data)).convert(mode).save(out, format="JPEG", quality=90, **options)
    return out.getvalue()


def crafted() -> dict[str, bytes]:
    """What nvJPEG must not be given, or must not be trusted with, beside good photos."""
    photo = photo_jpeg(500, 375, seed=9)
    sof = photo.index(b"\xff\xc0")
    bomb = bytearray(photo)
    bomb[sof + 5:sof + 9] = struct.pack(">HH", 60000, 60000)
    png = io.BytesIO()
    Image.open(io.BytesIO(photo)).save(png, format="PNG")
    corrupt = bytearray(photo)
    corrupt[len(photo) // 2:len(photo) // 2 + 400] = bytes(range(256)) + bytes(144)  # entropy data destroyed, ends intact
    return {"progressive": reencode(photo, progressive=True), "cmyk": reencode(photo, "CMYK"),
            "truncated": photo[:len(photo) // 2], "png": png.getvalue(), "bomb": bytes(bomb[:sof + 64]) + b"\xff\xd9",
            "not an image": b"\xff\xd8\xff\xe0 nothing here \xff\xd9", "corrupt": bytes(corrupt)}


def test_the_plan_gives_nvjpeg_baseline_jpegs_only() -> None:
    files = crafted()
    assert device_jpeg_plan(photo_jpeg(500, 375, seed=1), SPEC, LIMIT) == ((224, 224), False, 500 * 375)
    for name in ("progressive", "cmyk", "truncated", "png", "bomb", "not an image"):
        assert device_jpeg_plan(files[name], SPEC, LIMIT) is None, name
    # where the CPU path decodes at a reduced scale (the contract's draft), the CPU keeps it too
    assert device_jpeg_plan(photo_jpeg(500, 375, seed=1), InputSpec(3, 32, 32), LIMIT) is None


def test_a_batch_of_photos_decodes_as_the_cpu_path_does() -> None:
    photos = [photo_jpeg(500, 375, seed=i) for i in range(5)] + [photo_jpeg(500, 375, seed=7)]
    decoder = DeviceJpegDecoder(torch.device("cpu"), LIMIT, batch_pixels=10**9)
    cpu, calls = cpu_path()
    rows = decoder.decode(photos, SPEC, cpu)
    assert not calls and decoder.on_device == len(photos)
    for row, photo in zip(rows, photos, strict=True):
        assert isinstance(row, torch.Tensor) and row.dtype == torch.uint8 and tuple(row.shape) == (3, 224, 224)
        expected = decode_image(photo, SPEC, LIMIT).astype(int)
        assert np.abs(row.numpy().astype(int) - expected).max() <= JPEG_TOLERANCE_MAX


def test_hostile_files_fall_back_alone_and_their_batch_mates_keep_their_rows() -> None:
    files = crafted()
    good = [photo_jpeg(500, 375, seed=i) for i in range(3)]
    blobs = [good[0], *files.values(), good[1], good[2]]
    names = ["good", *files, "good", "good"]
    decoder = DeviceJpegDecoder(torch.device("cpu"), LIMIT, batch_pixels=10**9)
    cpu, calls = cpu_path()
    rows = decoder.decode(blobs, SPEC, cpu)
    assert len(rows) == len(blobs)
    outcome = {name: (row.status if isinstance(row, BadImage) else "row") for name, row in zip(names, rows, strict=True)}
    assert outcome == {"good": "row", "progressive": "row", "cmyk": "row", "truncated": 415, "png": "row",
                       "bomb": 413, "not an image": 415, "corrupt": outcome["corrupt"]}
    for blob, row in zip(blobs, rows, strict=True):
        if blob in good:
            assert np.abs(row.numpy().astype(int) - decode_image(blob, SPEC, LIMIT).astype(int)).max() <= 1
    # the corrupt file was given to the device decoder (whole header, end marker): the batch call
    # failed or it decoded; either way every good photo has its own row and the rest went to the CPU
    assert {"progressive", "cmyk", "truncated", "png", "bomb", "not an image"} <= {
        name for name, blob in zip(names, blobs, strict=True) if blob in calls}


def test_a_batch_is_split_under_the_pixel_budget() -> None:
    photos = [photo_jpeg(500, 375, seed=i) for i in range(5)]
    decoder = DeviceJpegDecoder(torch.device("cpu"), LIMIT, batch_pixels=2 * 500 * 375)
    plans = [device_jpeg_plan(p, SPEC, LIMIT) for p in photos]
    assert decoder._groups(plans) == [[0, 1], [2, 3], [4]]
    cpu, calls = cpu_path()
    assert all(isinstance(r, torch.Tensor) for r in decoder.decode(photos, SPEC, cpu)) and not calls


@pytest.mark.gpu
def test_on_a_gpu_hostile_files_leave_the_device_in_service() -> None:
    """nvJPEG on the worker's GPU: crafted files fall back or are refused, the good photos decode
    on the device, and the device still computes afterwards (no sticky error)."""
    device = torch.device("cuda")
    files = crafted()
    good = [photo_jpeg(500, 375, seed=i) for i in range(8)]
    decoder = DeviceJpegDecoder(device, LIMIT, batch_pixels=4 * 500 * 375)
    cpu, _ = cpu_path()
    rows = decoder.decode([*good, *files.values(), *good], SPEC, cpu)
    for row, blob in zip(rows, [*good, *files.values(), *good], strict=True):
        if blob in good:
            assert isinstance(row, torch.Tensor) and row.device.type == "cuda"
            assert (row.cpu().int() - torch.from_numpy(decode_image(blob, SPEC, LIMIT)).int()).abs().max() <= 2
    assert decoder.on_device >= len(good) * 2
    assert (torch.ones(4, device=device) * 2).sum().item() == 8  # the context still works
