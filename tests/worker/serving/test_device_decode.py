"""/predict's JPEGs decoded on the device (worker/data/device_jpeg.py): the selection, the
grouping under a pixel budget, and every fallback, run by its CPU twin (torchvision's decode_jpeg
takes device="cpu" the same way), plus the same checks on a GPU (`gpu` marker: skipped here) with
crafted files. Each image's row is the contract's (the CPU path's) within JPEG_TOLERANCE, and one
hostile file never costs its batch-mates their rows."""

from __future__ import annotations

import io
import json
import struct

import numpy as np
import pytest
import redis
import torch
from PIL import Image

from core import keys
from core.storage import CheckpointPaths
from core.wire import PredictReply
from tests.datagen import photo_jpeg
from tests.worker.serving.test_engine import META, _encode, _request, _rgb, _save
from worker.data import torch_jpeg  # noqa: F401  (imported: decode_image's CPU path uses it from the first call)
from worker.data.device_jpeg import DeviceJpegDecoder, device_decodes, device_jpeg_plan, pixel_groups
from worker.data.image_array import JPEG_TOLERANCE_MAX, BadImage, InputSpec, decode_image
from worker.data.normalization import normalize, stats_tensors
from worker.device.pinning import WorkerDevice
from worker.serving.engine import InferenceServer
from worker.serving.model_cache import ModelCache

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


def test_decode_setting_chooses_the_device_on_a_cuda_worker_only() -> None:
    assert device_decodes("auto", "cuda") and device_decodes("cuda", "cuda")
    assert not device_decodes("cpu", "cuda") and not device_decodes("auto", "cpu") and not device_decodes("cuda", "cpu")


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
    assert pixel_groups(plans, 2 * 500 * 375) == [[0, 1], [2, 3], [4]]
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


def test_the_engine_answers_from_device_decoded_rows_as_from_the_cpu_path(clean_redis_url: str, tmp_path) -> None:
    """A CPU worker's engine with the device decode turned on (its CPU twin): JPEG photos decoded by
    the device decoder, a PNG and the refusals by the CPU path, one batch; every answer is the CPU
    path's prediction (same top-1, probabilities within 1e-3) and the bad files are refused alone."""
    client = redis.Redis.from_url(clean_redis_url)
    paths = CheckpointPaths(tmp_path)
    model = _save(paths, "job-a", 5)
    device = WorkerDevice("cpu", None, "testnode")
    server = InferenceServer(client, device, ModelCache(paths, "cpu", 2, 1 << 30), max_batch=32, max_wait_ms=5,
                             max_pixels=LIMIT, device_decode=True)
    assert server.decoder.device_decoder is not None
    photos = [photo_jpeg(48, 40, seed=i) for i in range(4)]  # full scale to 32×32: the device decoder's
    png = _encode(_rgb(3), "PNG")
    queue = keys.predict_queue(device.id)
    for i, blob in enumerate([*photos, png]):
        client.rpush(queue, _request("job-a", [blob], f"reply:{i}"))
    client.rpush(queue, _request("job-a", [photos[0], photos[1][:200]], "reply:truncated"))
    client.rpush(queue, _request("job-a", [b"\xff\xd8\xff garbage \xff\xd9"], "reply:garbage"))
    server.start()
    try:
        keys_wanted = [*(f"reply:{i}" for i in range(5)), "reply:truncated", "reply:garbage"]
        replies = {key: client.blpop([key], timeout=30) for key in keys_wanted}
    finally:
        server.stop()
        server.join()
    assert all(replies.values()), replies
    addressed = {key: PredictReply.decode_addressed(value[1].decode())[1] for key, value in replies.items()}
    assert str(addressed.pop("reply:truncated").status) == "415" and str(addressed.pop("reply:garbage").status) == "415"
    assert server.decoder.device_decoder.on_device >= 4
    mean, std = stats_tensors(META.preprocessing, "cpu")
    spec = InputSpec.of(META.preprocessing)
    with torch.inference_mode():
        x = torch.from_numpy(np.stack([decode_image(b, spec, LIMIT) for b in [*photos, png]]))
        expected = torch.softmax(model(normalize(x, mean, std)), dim=1)
    for i in range(5):
        reply = addressed[f"reply:{i}"]
        assert str(reply.status) == "200", reply
        top = json.loads(reply.body)["results"][0]["predictions"]
        assert top[0]["index"] == expected[i].argmax().item()
        assert all(abs(p["probability"] - expected[i][p["index"]].item()) <= 1e-3 for p in top)
