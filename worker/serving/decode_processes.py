"""/predict images decoded in processes of their own: the decode stage's way onto every core.

Why processes: a photo's decode holds the GIL for a share of its time (opening, the plugin's
header parsing, the array at the end; bench/decode_gil.py measures it, docs/benchmarks.md), so
threads of one process decode photos at a few cores' worth however many the host has, which on a
GPU host is what bounded /predict ("Photos on a GPU host"). Processes are bounded by the cores.
What they cost the worker is each image's bytes pickled in and its array pickled back, a small
fraction of a photo's decode; small images, for which that would not pay, are decoded in the
worker's own thread (worker/serving/decode.DecodeSplit).

This module imports no torch, so a decoding process starts in milliseconds from the worker's
forkserver (worker/data/forkserver.py: a clean process started with the worker, safe in a worker that
runs threads and holds a CUDA context, this module preloaded); it imports torch and torchvision
on a thread from its first JPEG for torchvision (worker/data/torch_jpeg.py; Pillow decodes until
they are in), and never touches a device. Decoding processes end with the worker however it ends.

A decoding process can die at any moment (a decoder crash on a hostile file, the OOM killer, any
signal), which breaks its pool, or stop (a stuck decoder, SIGSTOP, a thrashing host), which would
hold its chunk, and the batches behind it, for ever. Both are handled wherever the pool is used:

- a submit that finds the pool broken (a process that died while idle) replaces it and submits
  the chunk to the new one, so no batch is lost to a pool that broke between two batches;
- a chunk whose pool broke, or that is not back within the decode timeout (counted from when its
  batch is awaited, when its chunks are the oldest in the pool's queue), is *lost*: a pool that
  timed out has its processes killed (a stopped process ignores anything less) and is replaced;
- a lost chunk's images are decoded again one at a time in a process of their own, the
  quarantine, where a death or a stall can only be that image's doing: an image that kills its
  decoder there (the second time) or outlasts the timeout alone is refused (415) for itself, and
  every other image of the batch is answered.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import NamedTuple

import numpy as np

from worker.data import forkserver
from worker.data.image_array import BadImage, InputSpec, decode_image

log = logging.getLogger(__name__)

# One image's outcome in a decoding process: its row, or the HTTP status and detail of why not.
Failure = tuple[int, str]
# A future that will never have its chunk: its pool broke (a process died) or was replaced.
LOST = (BrokenProcessPool, CancelledError)
CRASHED = (415, "cannot decode image: it crashed the decoder")


class Chunk(NamedTuple):
    """A chunk decoded: its rows (a refused image's row left as it was), per image None or
    (status, detail), and the CPU seconds it took (what decides the next batches' split)."""

    rows: np.ndarray
    failures: list[Failure | None]
    cpu_s: float


class Sent(NamedTuple):
    """A chunk on its way, and the pool it went to (None: none would take it; it is lost)."""

    pool: ProcessPoolExecutor | None
    future: Future[Chunk]


def decode_chunk(blobs: Sequence[bytes], spec: InputSpec, max_pixels: int) -> Chunk:
    """Decode `blobs` at `spec` (worker/data/image_array.decode_image), in a decoding process or in
    the calling thread."""
    began = time.thread_time()
    out = spec.empty(len(blobs))
    failures: list[Failure | None] = []
    for i, data in enumerate(blobs):
        try:
            out[i] = decode_image(data, spec, max_pixels)
            failures.append(None)
        except BadImage as bad:
            failures.append((bad.status, bad.detail))
    return Chunk(out, failures, time.thread_time() - began)


class PoolSlot:
    """One pool of decoding processes, started on first use, replaced when it breaks or stalls.

    Replacing is compare-and-swap: a thread that saw an old pool fail (the intake submitting, the
    assembly gathering) never throws away the fresh pool another thread has just started."""

    def __init__(self, processes: int, role: str) -> None:
        self.processes = processes
        self.role = role
        self.replacements = 0
        self._pool: ProcessPoolExecutor | None = None
        self._closed = False
        self._lock = threading.Lock()

    def current(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._closed:
                raise RuntimeError("the decoding processes are shut down")
            if self._pool is None:
                self._pool = ProcessPoolExecutor(self.processes, mp_context=forkserver.context(),
                                                 initializer=forkserver.end_with, initargs=(os.getpid(),))
            return self._pool

    def replace(self, pool: ProcessPoolExecutor, why: str) -> None:
        """`pool` is done for (`why`): the next use starts a fresh one, and its processes are killed."""
        with self._lock:
            current = self._pool is pool
            if current:
                self._pool = None
                self.replacements += 1
        if current:
            log.warning("a /predict %s process %s; the pool is replaced", self.role, why)
        _end(pool)

    def close(self) -> None:
        with self._lock:
            pool, self._pool, self._closed = self._pool, None, True
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


class DecodeProcesses:
    """The decoding pool and its one-process quarantine, kept for the worker's life.

    `timeout_s`: how long a batch's chunks (or one image in the quarantine) may take once awaited
    before their process is taken as stuck; None waits as long as it takes (benches)."""

    def __init__(self, processes: int, max_pixels: int, timeout_s: float | None = None) -> None:
        self.processes = max(1, processes)
        self.max_pixels = max_pixels
        self.timeout_s = timeout_s
        self._pool = PoolSlot(self.processes, "decoding")
        self._quarantine = PoolSlot(1, "quarantined decoding")

    @property
    def replacements(self) -> int:
        """Pools replaced since the start (a process died or stalled): the log says each one."""
        return self._pool.replacements + self._quarantine.replacements

    def submit(self, blobs: Sequence[bytes], spec: InputSpec) -> Sent:
        """`blobs` on their way as one chunk. A pool found broken here (a process died while idle)
        is replaced and the chunk submitted to the new one; a chunk no pool takes is lost, and
        `gather` decodes its images alone."""
        for _ in range(2):
            pool = self._pool.current()
            try:
                return Sent(pool, pool.submit(decode_chunk, list(blobs), spec, self.max_pixels))
            except RuntimeError:  # BrokenProcessPool, or shut down by the thread that replaced it
                self._pool.replace(pool, "had died while idle")
        lost: Future[Chunk] = Future()
        lost.set_exception(BrokenProcessPool("the decoding pool broke again as it started"))
        return Sent(None, lost)

    def gather(self, chunks: list[list[bytes]], sent: list[Sent], spec: InputSpec) -> list[Chunk]:
        """Each chunk's result, in order. A lost chunk (its pool broke, or it is not back within
        the timeout: its pool is then replaced) is decoded again one image at a time, alone."""
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        results: list[Chunk | None] = []
        for pool, future in sent:
            try:
                results.append(future.result(None if deadline is None else max(0.0, deadline - time.monotonic())))
                continue
            except LOST:
                if pool is not None:
                    self._pool.replace(pool, "died while it held a chunk")
            except TimeoutError:
                if pool is not None:
                    self._pool.replace(pool, f"did not finish a chunk within {self.timeout_s:g}s: stuck")
            results.append(None)
        return [result if result is not None else self._one_by_one(chunk, spec)
                for chunk, result in zip(chunks, results, strict=True)]

    def shutdown(self) -> None:
        self._pool.close()
        self._quarantine.close()

    def _one_by_one(self, chunk: list[bytes], spec: InputSpec) -> Chunk:
        out = spec.empty(len(chunk))
        failures: list[Failure | None] = []
        cpu_s = 0.0
        for i, data in enumerate(chunk):
            one = self._alone(data, spec)
            if isinstance(one, Chunk):
                out[i] = one.rows[0]
                failures.append(one.failures[0])
                cpu_s += one.cpu_s
            else:
                failures.append(one)
        return Chunk(out, failures, cpu_s)

    def _alone(self, data: bytes, spec: InputSpec) -> Chunk | Failure:
        """`data` decoded by itself in the quarantine: a death or a stall there is this image's."""
        for _ in range(2):
            pool = self._quarantine.current()
            try:
                future = pool.submit(decode_chunk, [data], spec, self.max_pixels)
            except RuntimeError:  # it died while idle (the OOM killer): not this image's doing
                self._quarantine.replace(pool, "had died while idle")
                continue
            try:
                return future.result(self.timeout_s)
            except LOST:
                self._quarantine.replace(pool, "died decoding one image alone: that image is refused")
                return CRASHED
            except TimeoutError:
                self._quarantine.replace(pool, f"did not decode one image alone within {self.timeout_s:g}s: "
                                               "that image is refused")
                return 415, f"cannot decode image: its decode did not end within {self.timeout_s:g}s"
        return 503, "the decoding processes could not be started"


def _end(pool: ProcessPoolExecutor) -> None:
    """Kill `pool`'s processes and let it go. SIGKILL, since a stopped process ignores anything less
    (the pool's own clean-up sends SIGTERM and then waits for each, for ever on a stopped one)."""
    forkserver.kill_processes(pool)
    pool.shutdown(wait=False, cancel_futures=True)
