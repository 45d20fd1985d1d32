"""An upload's first decode on a CUDA worker: nvJPEG for the JPEGs it takes, the process pool for the
rest, both at once (issue 40, item 2).

Why: the first job on a set of photos spends its first seconds decoding it (docs/benchmarks.md, "A
first job's fixed cost"), on the worker's cores, while its GPU idles; nvJPEG decodes a batch of
photos on the device for a fraction of that CPU. The rows come back into the set's host array
(uint8 N×C×H×W, the array the pool fills and the cache stores), so nothing after the decode
changes: the trainer, the cache and /predict see the same preprocessing contract, within
JPEG_TOLERANCE of the Pillow rows the pool makes of the same files.

What goes to the device is /predict's plan (worker/data/device_jpeg.device_jpeg_plan, on each
file's bytes: an 8-bit baseline JPEG with its end marker, under the pixel limit, a resize the CPU
path makes at full scale); everything else (progressive, CMYK, 12-bit, PNG, a truncated or crafted
file, a photo the contract decodes at a reduced scale) and every file nvJPEG refuses after its
retry alone goes to worker/data/dataset_decode.py's pool, which decodes it or skips it with a
warning as it always did. The pool starts first, on the CPU files, in a thread of its own; the
device batches run meanwhile in the calling thread, one nvJPEG call per group of at most
`batch_pixels` decoded pixels (`pixel_groups`: device memory stays bounded by the headers, before
any decode), each group's rows resized on the device and copied back in one transfer. A sticky
device error is re-raised (worker/device/health.py), so the job's failure path takes the worker out
of service as a training step's would; the pool then sends no further chunk.

`DeviceDecode.chosen` decides from TORCHYARD_DECODE and the device's kind (`device_decodes`); the
CPU twin is the same code with `device="cpu"` (torchvision's decode_jpeg and resize take it the same
way), which the tests pass explicitly to load_image_folder.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from core.config import Settings
from worker.data.dataset_decode import DECODE_NICE, DecodedFiles, DecodeReport, compact, decode_into
from worker.data.device_jpeg import DeviceJpegDecoder, Plan, device_decodes, device_jpeg_plan, pixel_groups
from worker.data.image_array import BadImage, InputSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceDecode:
    """Where an upload's JPEGs decode (a torch device), under which pixel limit, in nvJPEG calls of
    at most `batch_pixels` decoded pixels."""

    device: str
    max_pixels: int
    batch_pixels: int

    @classmethod
    def chosen(cls, settings: Settings, torch_device: str | None) -> DeviceDecode | None:
        """A worker's choice for its device (None: the pool alone): TORCHYARD_DECODE as /predict reads
        it, by the device's kind, so a CPU worker never decodes here."""
        if torch_device is None or not device_decodes(settings.decode, torch.device(torch_device).type):
            return None
        return cls(torch_device, settings.max_image_pixels, settings.decode_batch_pixels)


def decode_files_on_device(paths: Sequence[Path], spec: InputSpec, workers: int, decode: DeviceDecode, *,
                           nice: int = DECODE_NICE) -> DecodedFiles:
    """`paths` decoded into one uint8 array, the planned JPEGs by nvJPEG on `decode.device`, the rest
    by `workers` pool processes at the same time; unreadable files skipped as decode_files skips them."""
    files = [str(p) for p in paths]
    plans = [_plan(path, spec, decode.max_pixels) for path in files]
    images = spec.empty(len(files))
    readable = np.zeros(len(files), dtype=bool)
    on_cpu = [i for i, plan in enumerate(plans) if plan is None]
    stop = threading.Event()
    pool = _PoolThread(files, on_cpu, spec, workers, images, readable, nice, stop)
    groups = pixel_groups(plans, decode.batch_pixels)
    decoder = DeviceJpegDecoder(torch.device(decode.device), decode.max_pixels, decode.batch_pixels)
    refused: list[int] = []
    try:
        for group in groups:
            refused += _decode_group(decoder, files, group, plans, spec, images, readable)
    except BaseException:
        stop.set()  # a sticky device error: the pool sends nothing more, and this error is the one raised
        pool.join(raising=False)
        raise
    pool.join()
    if refused:  # nvJPEG refused them even alone: the pool decodes them, or skips them, saying why
        log.info("%d files nvJPEG refused go to the decoding processes", len(refused))
        decode_into(files, refused, spec, workers, images, readable, nice=nice)
    batches = tuple(sum(plan[2] for i in group if (plan := plans[i]) is not None) for group in groups)
    report = DecodeReport(on_device=len(files) - len(on_cpu) - len(refused), on_cpu=len(on_cpu) + len(refused),
                          device_batches=batches)
    log.info("decoded %d files on %s (%d nvJPEG calls), %d by the decoding processes", report.on_device,
             decode.device, len(batches), report.on_cpu)
    return compact(images, readable, report)


def _plan(path: str, spec: InputSpec, max_pixels: int) -> Plan | None:
    """The file's device plan, read from its bytes (the end marker needs them all); None for the
    pool, which also says why a file it cannot read is skipped."""
    try:
        return device_jpeg_plan(Path(path).read_bytes(), spec, max_pixels)
    except (OSError, BadImage):
        return None


def _decode_group(decoder: DeviceJpegDecoder, files: list[str], group: list[int], plans: list[Plan | None],
                  spec: InputSpec, images: np.ndarray, readable: np.ndarray) -> list[int]:
    """One nvJPEG call's files into their rows (one copy back for the group); the indices of those it
    refused, or that could not be read again, for the pool."""
    blobs: list[bytes] = []
    taken: list[int] = []
    refused: list[int] = []
    for i in group:
        try:
            blobs.append(Path(files[i]).read_bytes())
            taken.append(i)
        except OSError:
            refused.append(i)
    rows = decoder.decode_batch(blobs, [plan for i in taken if (plan := plans[i]) is not None], spec) if blobs else []
    done = [(i, row) for i, row in zip(taken, rows, strict=True) if row is not None]
    refused += [i for i, row in zip(taken, rows, strict=True) if row is None]
    if done:
        where = [i for i, _ in done]
        images[where] = torch.stack([row for _, row in done]).cpu().numpy()
        readable[where] = True
    return refused


class _PoolThread:
    """The process pool on the CPU files, in a thread of its own while the device decodes; its
    error, if any, raised in the caller at `join`."""

    def __init__(self, files: list[str], indices: list[int], spec: InputSpec, workers: int, images: np.ndarray,
                 readable: np.ndarray, nice: int, stop: threading.Event) -> None:
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        if indices:
            self.thread = threading.Thread(target=self._run, args=(files, indices, spec, workers, images, readable,
                                                                   nice, stop), name="dataset-decode-pool", daemon=True)
            self.thread.start()

    def _run(self, files: list[str], indices: list[int], spec: InputSpec, workers: int, images: np.ndarray,
             readable: np.ndarray, nice: int, stop: threading.Event) -> None:
        try:
            decode_into(files, indices, spec, workers, images, readable, nice=nice, stop=stop)
        except BaseException as exc:  # DecodeFailed: raised in the caller's thread, at join
            self.error = exc

    def join(self, *, raising: bool = True) -> None:
        if self.thread is not None:
            self.thread.join()
        if raising and self.error is not None:
            raise self.error
