"""/predict's decoding processes (worker/serving/decode_processes.py), real processes: the same rows
as the intake thread's own decode, refusals per image, and a decoding process that dies (SIGKILL,
mid-chunk or while idle) or stops (SIGSTOP mid-chunk) costs nothing but time: every image of
every later batch is answered, the stopped one within the decode timeout."""

from __future__ import annotations

import io
import os
import signal

import numpy as np
import psutil
from PIL import Image

from tests.support import wait_until
from worker.data.image_array import BadImage, InputSpec, decode_image
from worker.serving.decode_processes import Chunk, DecodeProcesses

SPEC = InputSpec(3, 64, 64)


def _jpeg(seed: int, size: int = 320) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)).save(
        buffer, "JPEG", quality=90)
    return buffer.getvalue()


def _expected(data: bytes) -> np.ndarray | int:
    try:
        return decode_image(data, SPEC, 10**7)
    except BadImage as bad:
        return bad.status


def _outcomes(results: list[Chunk]) -> list[np.ndarray | int]:
    return [row if failure is None else failure[0]
            for rows, failures, _ in results for row, failure in zip(rows, failures, strict=True)]


def _decode(processes: DecodeProcesses, chunks: list[list[bytes]]) -> list[np.ndarray | int]:
    return _outcomes(processes.gather(chunks, [processes.submit(chunk, SPEC) for chunk in chunks], SPEC))


def _assert_decoded(got: list[np.ndarray | int], images: list[bytes]) -> None:
    assert len(got) == len(images)
    for outcome, data in zip(got, images, strict=True):
        assert np.array_equal(outcome, _expected(data))


def _pids(processes: DecodeProcesses, count: int) -> list[int]:
    pool = processes._pool.current()
    wait_until(lambda: len(pool._processes) >= count, timeout=30, what=f"{count} decoding processes")
    return list(pool._processes)


def test_decoding_processes_give_the_intake_threads_rows_and_refusals() -> None:
    images = [_jpeg(1), b"not an image", _jpeg(2), _jpeg(3, size=1200)]  # the last: 1.44 M pixels
    processes = DecodeProcesses(2, max_pixels=10**6)
    try:
        got = _decode(processes, [images[:2], images[2:]])
    finally:
        processes.shutdown()
    assert got[1] == 415 and got[3] == 413
    for index in (0, 2):
        assert np.array_equal(got[index], _expected(images[index]))


def test_a_decoding_process_killed_mid_chunk_costs_only_time() -> None:
    images = [_jpeg(seed, size=1000) for seed in range(24)]  # a few ms each: the chunk is under way
    processes = DecodeProcesses(2, max_pixels=10**7)
    try:
        chunks = [images[:12], images[12:]]
        pending = [processes.submit(chunk, SPEC) for chunk in chunks]
        pool = processes._pool.current()
        os.kill(_pids(processes, 2)[0], signal.SIGKILL)
        got = _outcomes(processes.gather(chunks, pending, SPEC))
        assert processes._pool.current() is not pool and processes.replacements >= 1
    finally:
        processes.shutdown()
    _assert_decoded(got, images)


def test_a_decoding_process_killed_while_idle_costs_no_later_batch() -> None:
    """The OOM killer may pick a decoder between two batches: its pool is broken before any batch
    sees it die, and every submit to it raised BrokenProcessPool (on the intake thread, which only
    logged it) until the worker restarted."""
    images = [_jpeg(seed) for seed in range(8)]
    processes = DecodeProcesses(2, max_pixels=10**7)
    try:
        _assert_decoded(_decode(processes, [images[:4], images[4:]]), images)
        pool = processes._pool.current()
        victim = psutil.Process(_pids(processes, 2)[0])
        victim.kill()
        victim.wait(30)
        wait_until(lambda: pool._broken, timeout=30, what="the pool to notice its dead process")
        for _ in range(3):  # each later batch, not only the first
            _assert_decoded(_decode(processes, [images[:4], images[4:]]), images)
    finally:
        processes.shutdown()


def test_a_decoding_process_stopped_mid_chunk_is_killed_at_the_timeout_and_its_images_decoded_again() -> None:
    """A stuck decoder (here SIGSTOPped while it holds its chunk) held the batch, and every batch
    behind it, for ever; now it is killed once the timeout has passed and its chunk's images are
    decoded again, alone."""
    images = [_jpeg(seed, size=1000) for seed in range(24)]
    processes = DecodeProcesses(2, max_pixels=10**7, timeout_s=1.0)
    stopped: list[psutil.Process] = []
    try:
        chunks = [images[:12], images[12:]]
        pending = [processes.submit(chunk, SPEC) for chunk in chunks]
        for pid in _pids(processes, 2):  # both stopped: whichever holds a chunk holds it for good
            process = psutil.Process(pid)
            process.suspend()
            stopped.append(process)
        got = _outcomes(processes.gather(chunks, pending, SPEC))
        assert processes.replacements >= 1
        for process in stopped:  # killed by the pool's replacement, not left stopped
            wait_until(lambda p=process: not p.is_running() or p.status() == psutil.STATUS_ZOMBIE, timeout=30,
                       what=f"the stopped decoding process {process.pid} to be killed")
        _assert_decoded(got, images)
        _assert_decoded(_decode(processes, chunks), images)  # and the fresh pool serves
    finally:
        for process in stopped:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        processes.shutdown()
