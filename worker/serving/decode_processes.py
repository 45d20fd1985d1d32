"""/predict images decoded in processes of their own: the decode stage's way onto every core.

Why processes: a photo's decode holds the GIL for a share of its time (opening, the plugin's
header parsing, the array at the end; bench/decode_gil.py measures it, docs/benchmarks.md), so
threads of one process decode photos at a few cores' worth however many the host has, which on a
GPU host is what bounded /predict ("Photos on a GPU host"). Processes are bounded by the cores.
What they cost the worker is each image's bytes pickled in and its array pickled back, a small
fraction of a photo's decode; small images, for which that would not pay, are decoded in the
worker's own thread (worker/serving/decode.DecodeSplit).

This module imports no torch (nor does worker/preprocess.py), so a decoding process starts in
milliseconds from the worker's forkserver (worker/forkserver.py: a clean process started with the
worker, safe in a worker that runs threads and holds a CUDA context, this module preloaded) and
stays small; decoding processes end with the worker however it ends.

A decoding process that dies (a decoder crash on a hostile file, the OOM killer) breaks the pool:
the batch's images are then decoded again one at a time in a fresh pool, and an image that kills
its decoder again is refused (415) without taking the worker, or anyone else's request, down.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import select
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import NamedTuple

import numpy as np
from PIL import Image

from core.images import IMAGE_FORMATS
from worker import forkserver
from worker.preprocess import image_to_array

log = logging.getLogger(__name__)

# (channels, height, width, resize_size): what a checkpoint's preprocessing asks of an image
Spec = tuple[int, int, int, int | None]
# One image's outcome in a decoding process: its row, or the HTTP status and detail of why not.
Failure = tuple[int, str]


def decode_one(data: bytes, spec: Spec, max_pixels: int) -> np.ndarray:
    """Bytes → C×H×W uint8 at `spec`; raises ValueError(status, detail) for what cannot be an input."""
    channels, height, width, resize_size = spec
    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as image:
            if image.width * image.height > max_pixels:
                raise Refused(413, f"image has {image.width * image.height} pixels, over the limit of {max_pixels}")
            return image_to_array(image, channels, height, width, resize_size)
    except Refused:
        raise
    except Image.DecompressionBombError:
        raise Refused(413, f"image has too many pixels; the limit is {max_pixels}") from None
    except Exception as exc:  # truncated, not an image, corrupt palette, ...
        raise Refused(415, f"cannot decode image: {exc}") from exc


class Refused(ValueError):
    """What cannot be a model's input: 413 (too many pixels) or 415 (not an image we decode)."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


class Chunk(NamedTuple):
    """A chunk decoded: its rows (a refused image's row left as it was), per image None or
    (status, detail), and the CPU seconds it took (what decides the next batches' split)."""

    rows: np.ndarray
    failures: list[Failure | None]
    cpu_s: float


def decode_chunk(blobs: Sequence[bytes], spec: Spec, max_pixels: int) -> Chunk:
    """Decode `blobs` at `spec`, in a decoding process or in the calling thread."""
    began = time.thread_time()
    channels, height, width, _ = spec
    out = np.empty((len(blobs), channels, height, width), dtype=np.uint8)
    failures: list[Failure | None] = []
    for i, data in enumerate(blobs):
        try:
            out[i] = decode_one(data, spec, max_pixels)
            failures.append(None)
        except Refused as refused:
            failures.append((refused.status, refused.detail))
    return Chunk(out, failures, time.thread_time() - began)


class DecodeProcesses:
    """A pool of decoding processes, started on first use and kept for the worker's life."""

    def __init__(self, processes: int, max_pixels: int) -> None:
        self.processes = max(1, processes)
        self.max_pixels = max_pixels
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def submit(self, blobs: Sequence[bytes], spec: Spec) -> Future[Chunk]:
        return self._running().submit(decode_chunk, list(blobs), spec, self.max_pixels)

    def gather(self, chunks: list[list[bytes]], futures: list[Future[Chunk]],
               spec: Spec) -> list[Chunk]:
        """Each chunk's result. A pool broken by a dead process is started again and the chunks it
        lost are decoded one image at a time; an image that kills its decoder again is refused."""
        results: list[Chunk | None] = []
        broken = False
        for future in futures:
            try:
                results.append(future.result())
            except BrokenProcessPool:
                broken = True
                results.append(None)
        if broken:
            self._restart()
            results = [result if result is not None else self._one_by_one(chunk, spec)
                       for chunk, result in zip(chunks, results, strict=True)]
        return [result for result in results if result is not None]

    def shutdown(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def _one_by_one(self, chunk: list[bytes], spec: Spec) -> Chunk:
        channels, height, width, _ = spec
        out = np.empty((len(chunk), channels, height, width), dtype=np.uint8)
        failures: list[Failure | None] = []
        cpu_s = 0.0
        for i, data in enumerate(chunk):
            try:
                one = self._running().submit(decode_chunk, [data], spec, self.max_pixels).result()
            except BrokenProcessPool:
                log.warning("an image killed its decoding process; refused, and the pool started again")
                self._restart()
                failures.append((415, "cannot decode image: it crashed the decoder"))
                continue
            out[i] = one.rows[0]
            failures.append(one.failures[0])
            cpu_s += one.cpu_s
        return Chunk(out, failures, cpu_s)

    def _running(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(self.processes, mp_context=forkserver.context(),
                                                 initializer=_end_with, initargs=(os.getpid(),))
            return self._pool

    def _restart(self) -> None:
        self.shutdown()


def _end_with(worker: int) -> None:
    """A decoding process: gone when the worker is. Its parent is the forkserver, which outlives a
    SIGKILLed worker while its children hold its pipe, and they would wait for work forever."""
    threading.Thread(target=_exit_after, args=(worker,), name="exit-with-worker", daemon=True).start()


def _exit_after(pid: int) -> None:
    try:
        select.select([os.pidfd_open(pid)], [], [])  # Linux 5.3 and later: readable once `pid` has ended
    except (AttributeError, OSError):  # no pidfd here, or `pid` is gone already
        with contextlib.suppress(ProcessLookupError):
            while True:
                os.kill(pid, 0)
                time.sleep(1.0)
    os._exit(1)
