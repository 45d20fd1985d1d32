"""/predict's decoding processes (worker/serving/decode_processes.py), real processes: the same rows
as the intake thread's own decode, refusals per image, and a decoding process SIGKILLed mid-chunk
costs nothing but time: the batch is decoded again and every image answered."""

from __future__ import annotations

import io
import os
import signal
import time

import numpy as np
from PIL import Image

from worker.serving.decode_processes import DecodeProcesses, Refused, decode_one

SPEC = (3, 64, 64, None)


def _jpeg(seed: int, size: int = 320) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)).save(
        buffer, "JPEG", quality=90)
    return buffer.getvalue()


def _expected(data: bytes) -> np.ndarray | int:
    try:
        return decode_one(data, SPEC, 10**6)
    except Refused as refused:
        return refused.status


def test_decoding_processes_give_the_intake_threads_rows_and_refusals() -> None:
    images = [_jpeg(1), b"not an image", _jpeg(2), _jpeg(3, size=1200)]  # the last: 1.44 M pixels
    processes = DecodeProcesses(2, max_pixels=10**6)
    try:
        chunks = [images[:2], images[2:]]
        results = processes.gather(chunks, [processes.submit(chunk, SPEC) for chunk in chunks], SPEC)
    finally:
        processes.shutdown()
    got: list[np.ndarray | int] = []
    for rows, failures, _ in results:
        got.extend(row if failure is None else failure[0] for row, failure in zip(rows, failures, strict=True))
    assert got[1] == 415 and got[3] == 413
    for index in (0, 2):
        assert np.array_equal(got[index], _expected(images[index]))


def test_a_decoding_process_killed_mid_chunk_costs_only_time() -> None:
    images = [_jpeg(seed, size=1000) for seed in range(24)]  # a few ms each: the chunk is under way
    processes = DecodeProcesses(2, max_pixels=10**7)
    try:
        chunks = [images[:12], images[12:]]
        pending = [processes.submit(chunk, SPEC) for chunk in chunks]
        pool = processes._running()
        deadline = time.monotonic() + 10
        while len(pool._processes) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        victim = next(iter(pool._processes))
        os.kill(victim, signal.SIGKILL)
        results = processes.gather(chunks, pending, SPEC)
        assert processes._running() is not pool
    finally:
        processes.shutdown()
    rows = [row for chunk_rows, failures, _ in results for row, failure in zip(chunk_rows, failures, strict=True)
            if failure is None]
    assert len(rows) == len(images)
    for row, data in zip(rows, images, strict=True):
        assert np.array_equal(row, _expected(data))
