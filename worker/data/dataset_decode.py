"""An uploaded `<class>/<image>` folder's files decoded across the worker's cores.

worker/data/datasets.py decodes a set once per input spec (channels, size, resize) and caches the result;
this module is how that one decode uses the host: a pool of processes, each decoding chunks of
files with worker/data/image_array.image_to_array (the transform /predict runs, JPEG draft included)
and sending back one uint8 array per chunk, which is copied into its rows of one array
allocated up front. Nothing else holds the decoded images: memory is that array plus the chunks
in flight (a few per process). On a CUDA worker the baseline JPEGs go to nvJPEG instead
(worker/data/device_dataset_decode.py), and this pool decodes the other files into the same array
meanwhile (`decode_into`, the files it is given by index).

Why processes and not threads (docs/benchmarks.md, "Dataset decode", has the figures and the
command): Pillow releases the GIL inside its decoder and its resampler, but everything around
them (opening the file, the plugin's header parsing, the array at the end) is Python or holds the
GIL. Timed per image in thread CPU time, a small share of a photo's decode holds the GIL, and most
of a small PNG's: by Amdahl's law a thread pool on a 16-core GPU host would decode photos at well
under half of what its cores can, and small images hardly faster than one thread. Processes are
bounded by the cores alone; what they cost the worker, each chunk's arrays copied out of the
pipe, is a small fraction of a photo's decode. And a process contains a decoder that crashes:
a native decoder's segfault kills one pool process, never the worker (below).

Why a forkserver (worker/data/forkserver.py): a worker runs threads and may hold a CUDA context, which
forking would copy; the worker's forkserver is a clean process, started when the worker starts,
with this module, its imports and the worker's main module preloaded, so a pool process forks
from it in milliseconds and finds what it runs already imported. This module,
worker/data/image_array.py and core/images.py import no torch, so neither the server nor a pool process
does (importing torch costs seconds and hundreds of megabytes); a script that decodes a set must
guard its work with `if __name__ == "__main__"` (each pool process imports the main module).

A pool process that dies (a decoder crash, the OOM killer, a stray signal) breaks the pool:
every chunk in flight fails at once, nothing hangs. Those chunks' files are then decoded again
one at a time, each in a fresh pool once the previous one broke, so exactly the files that kill
a decoder are skipped, with a warning, as unreadable files are; past MAX_CRASHES such files the
set fails with DecodeFailed. Pool processes run at a lower priority (the worker's /predict and
the job keep the cores when they want them) and end with the worker, however it ends.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from core.images import IMAGE_FORMATS
from worker.data import forkserver
from worker.data.image_array import InputSpec, image_to_array

log = logging.getLogger(__name__)

DECODE_NICE = 10  # decoding processes' niceness above the worker's (a batch prediction's decoders too)
CHUNKS_PER_PROCESS = 8  # chunks per pool process over a whole set: a slow chunk cannot leave the others idle
MAX_CHUNK = 64  # files per chunk at most: what is lost, and decoded again, when a pool process dies
IN_FLIGHT_PER_PROCESS = 2  # chunks submitted per pool process: one to decode, one queued behind it
MAX_CRASHES = 8  # files that killed a decoder before the whole set is refused


class DecodeFailed(Exception):
    """Decoding processes kept dying: the set cannot be decoded on this worker."""


@dataclass(frozen=True)
class DecodeReport:
    """Which decoder took a set's files: what a first job's figures name (bench/first_job.py)."""

    on_device: int  # rows decoded by nvJPEG (worker/data/device_dataset_decode.py)
    on_cpu: int  # files given to the process pool (the unreadable ones included)
    device_batches: tuple[int, ...] = ()  # decoded pixels of each nvJPEG call, in order


@dataclass(frozen=True)
class DecodedFiles:
    images: np.ndarray  # uint8 N×C×H×W: the readable files, in the order given
    kept: np.ndarray  # int64 N: which of the files given each row is
    report: DecodeReport


def decode_files(paths: Sequence[Path], spec: InputSpec, workers: int, *, nice: int = DECODE_NICE) -> DecodedFiles:
    """Decode `paths` with `workers` processes (niceness `nice` above the caller's); unreadable
    files are skipped with a warning."""
    images = spec.empty(len(paths))
    readable = np.zeros(len(paths), dtype=bool)
    decode_into([str(p) for p in paths], list(range(len(paths))), spec, workers, images, readable, nice=nice)
    return compact(images, readable, DecodeReport(on_device=0, on_cpu=len(paths)))


def decode_into(files: list[str], indices: list[int], spec: InputSpec, workers: int, images: np.ndarray,
                readable: np.ndarray, *, nice: int = DECODE_NICE, stop: threading.Event | None = None) -> None:
    """The files at `indices` decoded by the pool into their rows of `images`, `readable` set for
    each one read; unreadable files are skipped with a warning. Once `stop` is set no further
    chunk is sent (those in flight finish): the caller failed and the rest is not wanted."""
    lost = _decode_chunks(files, indices, spec, workers, nice, images, readable, stop)
    if lost and not (stop is not None and stop.is_set()):
        log.warning("a decoding process died; decoding the %d files it may have held one at a time", len(lost))
        _decode_one_by_one(files, lost, spec, nice, images, readable)


def compact(images: np.ndarray, readable: np.ndarray, report: DecodeReport) -> DecodedFiles:
    """The rows of readable files moved up over the others', in place, and the array shortened."""
    kept = np.flatnonzero(readable)
    if len(kept) < len(readable):
        for row, source in enumerate(kept):
            if row != source:
                images[row] = images[source]
        images.resize((len(kept), *images.shape[1:]), refcheck=False)
    return DecodedFiles(images, kept.astype(np.int64), report)


def decode_chunk(files: Sequence[str], spec: InputSpec) -> tuple[np.ndarray, list[str | None]]:
    """In a pool process: each file's array, and per file None or why it could not be read (its
    row is then left as it was). Any exception of one file's decode is that file's error."""
    out = spec.empty(len(files))
    errors: list[str | None] = []
    for i, path in enumerate(files):
        try:
            with Image.open(path, formats=IMAGE_FORMATS) as image:  # the allowlist (core/images.py)
                out[i] = image_to_array(image, spec.channels, spec.height, spec.width, spec.resize_size)
            errors.append(None)
        except Exception as exc:  # truncated, not an image, a decompression bomb, a broken palette, ...
            errors.append(f"{type(exc).__name__}: {exc}")
    return out, errors


def _decode_chunks(files: list[str], indices: list[int], spec: InputSpec, workers: int, nice: int,
                   images: np.ndarray, readable: np.ndarray, stop: threading.Event | None) -> list[int]:
    """The files at `indices` in chunks over the pool; the indices of the files of chunks lost to a
    dead process (the pool is then started again for the chunks not yet sent)."""
    size = max(1, min(MAX_CHUNK, -(-len(indices) // (workers * CHUNKS_PER_PROCESS))))
    pending = deque(indices[begin:begin + size] for begin in range(0, len(indices), size))
    lost: list[int] = []
    while pending and not (stop is not None and stop.is_set()):
        with _pool(workers, nice) as pool:
            in_flight: dict[Future, list[int]] = {}
            broken = False
            while (pending and not broken) or in_flight:
                if stop is not None and stop.is_set():
                    pending.clear()
                while pending and not broken and len(in_flight) < workers * IN_FLIGHT_PER_PROCESS:
                    chunk = pending.popleft()
                    try:
                        in_flight[pool.submit(decode_chunk, [files[i] for i in chunk], spec)] = chunk
                    except BrokenProcessPool:
                        lost.extend(chunk)
                        broken = True
                done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
                for future in done:
                    chunk = in_flight.pop(future)
                    try:
                        arrays, errors = future.result()
                    except BrokenProcessPool:
                        lost.extend(chunk)
                        broken = True
                        continue
                    _store(files, chunk, arrays, errors, images, readable)
            if broken:  # its clean-up could wait for ever on a process it started late (kill_processes)
                forkserver.kill_processes(pool)
    return sorted(lost)


def _decode_one_by_one(files: list[str], indices: list[int], spec: InputSpec, nice: int, images: np.ndarray,
                       readable: np.ndarray) -> None:
    """Each file alone in a pool process: one that kills it is skipped, and a fresh pool goes on."""
    crashed = 0
    remaining = deque(indices)
    while remaining:
        with _pool(1, nice) as pool:
            while remaining:
                index = remaining.popleft()
                try:
                    arrays, errors = pool.submit(decode_chunk, [files[index]], spec).result()
                except BrokenProcessPool:
                    forkserver.kill_processes(pool)
                    crashed += 1
                    log.warning("skipping %s: its decoding process died", files[index])
                    if crashed > MAX_CRASHES:
                        raise DecodeFailed(f"{crashed} files killed the process decoding them (the last: "
                                           f"{files[index]}); the set cannot be decoded here") from None
                    break
                _store(files, [index], arrays, errors, images, readable)


def _store(files: list[str], chunk: list[int], arrays: np.ndarray, errors: list[str | None], images: np.ndarray,
           readable: np.ndarray) -> None:
    images[chunk] = arrays
    for index, error in zip(chunk, errors, strict=True):
        if error is None:
            readable[index] = True
        else:
            log.warning("skipping unreadable image %s: %s", files[index], error)


@contextmanager
def _pool(workers: int, nice: int) -> Iterator[ProcessPoolExecutor]:
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=forkserver.context(), initializer=_start_decoder,
                               initargs=(os.getpid(), nice))
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _start_decoder(worker: int, nice: int) -> None:
    """A pool process: below the worker's priority, and gone when the worker is."""
    os.nice(nice)
    forkserver.end_with(worker)
