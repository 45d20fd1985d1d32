"""The decode stage: image bytes → the model's input (uint8 C×H×W), spread over the worker's cores.

Decoding is most of the CPU a prediction costs on a fast device, so it never runs on the thread
that feeds the device, and it uses the cores the worker is given: a batch's images are split
into chunks, decoded by processes of their own (worker/serving/decode_processes.py: a photo's
decode holds the GIL for too large a share for threads to scale), while the intake thread takes
the next batch off the list and hands it to the processes in turn. Each image goes through the
one image → array transform (worker/data/image_array.decode_image: the checkpoint's preprocessing,
the training evaluation transform, at the size the model needs, with libjpeg's scaled decoding
through `Image.draft` for JPEG), as training data and batch predictions do.

A small image is another matter: its decode costs less than sending it to a process and its
array back, so `DecodeSplit` keeps such images on the intake thread alone.

Preprocessed float32 inputs (the Open Inference Protocol's INPUT__0, core/wire.py's "fp32") have
nothing to decode: `Decoder.start_tensors` reads them in place, checked against the model's shape.

A decoding process that dies or stalls costs its chunk a second decode, one image at a time,
never a request (worker/serving/decode_processes.py): `PendingDecode.result` always returns a
row or a refusal for every image.

On a CUDA worker with TORCHYARD_DECODE=cuda or auto, a batch's baseline JPEGs are decoded by nvJPEG
on the device instead (worker/data/device_jpeg.py), on the assembly thread inside the engine's
stream, while the rest (and any the device refuses) take the path above: `DevicePendingDecode`.
Its rows are then device tensors, which the staging stacks on the device.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import numpy as np
import torch
from PIL import Image

from worker.checkpoints.format import ModelMeta
from worker.data.device_jpeg import DeviceJpegDecoder, device_jpeg_plan
from worker.data.image_array import BadImage, InputSpec, decode_image
from worker.serving.decode_processes import Chunk, DecodeProcesses, Sent, decode_chunk

Row = np.ndarray | torch.Tensor | BadImage


class DecodeSplit:
    """Over how many chunks a batch's images are decoded: one (the intake thread's) while they are
    cheap, one per core once they are not.

    A small image decodes in less than its trip to a decoding process and back costs, while a
    photo is mostly the decoder's work. The encoded size does not tell them apart (a small PNG of
    noise is a large file and cheap to decode), so the intake thread times its own share in CPU
    time and the split follows a running average of that.

    Where the processes start to pay is in the host's own units: REFERENCE_DECODES times what the
    reference image (`reference_decode_s`: a 32×32 PNG of noise, the cheapest image /predict sees)
    costs this process to decode. The trip to a process costs CPU in proportion to a core's speed,
    as a decode does; a fixed 120 µs, set where bench/decode_split.py found the crossing on one
    host, sent a slower host's 32×32 PNGs (74 µs there, more under load) to the processes, at three
    to four times the worker's CPU per request (docs/benchmarks.md, "The service's own CPU per
    request")."""

    REFERENCE_DECODES = 4.0  # the crossing: 120 µs on the 2-core AMD host, whose reference decode took 31 µs
    WEIGHT = 0.2  # of the newest batch in the running average

    def __init__(self, threads: int, pool_from_s: float | None = None) -> None:
        self.threads = max(1, threads)
        self.pool_from_s = pool_from_s if pool_from_s is not None else self.REFERENCE_DECODES * reference_decode_s()
        self.image_s: float | None = None  # running average of one image's decode CPU, once measured

    def chunks(self, images: int) -> int:
        """How many chunks (threads) a batch of `images` is decoded in."""
        if images <= 1 or self.image_s is None or self.image_s < self.pool_from_s:
            return 1
        return min(self.threads, images)

    def observe(self, cpu_s: float, images: int) -> None:
        """A batch's `images` decoded in `cpu_s` of CPU time (the intake's or the processes')."""
        if images <= 0:
            return
        one = cpu_s / images
        self.image_s = one if self.image_s is None else self.image_s + self.WEIGHT * (one - self.image_s)


def reference_decode_s(tries: int = 15) -> float:
    """This thread's CPU time to decode the reference image (a 32×32 PNG of noise) to 32×32 through
    the one transform, best of `tries` (the best is what the host can do; a busy moment only adds)."""
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(buffer, "PNG")
    data, spec = buffer.getvalue(), InputSpec(3, 32, 32)
    best = float("inf")
    for _ in range(tries):
        began = time.thread_time()
        decode_image(data, spec, 32 * 32)
        best = min(best, time.thread_time() - began)
    return best


class PendingDecode:
    """A batch's images on their way: decoded already (cheap images, on the intake thread), or in
    chunks over the decoding processes, collected in order by `result`."""

    def __init__(self, decoder: Decoder, spec: InputSpec, parts: list[list[bytes]], sent: list[Sent],
                 done: list[Chunk] | None = None) -> None:
        self.decoder, self.spec, self.parts, self.sent, self.done = decoder, spec, parts, sent, done

    def result(self) -> list[np.ndarray | BadImage]:
        chunks = self.done if self.done is not None else self.decoder.processes.gather(self.parts, self.sent,
                                                                                       self.spec)
        decoded: list[np.ndarray | BadImage] = []
        for chunk in chunks:
            decoded.extend(row if failure is None else BadImage(failure[1], failure[0])
                           for row, failure in zip(chunk.rows, chunk.failures, strict=True))
        if self.done is None:
            self.decoder.split.observe(sum(c.cpu_s for c in chunks), len(decoded))
        return decoded


class DevicePendingDecode:
    """A batch whose planned JPEGs decode on the device when it is collected (the assembly thread,
    inside the engine's stream: the device loop's forward follows them there in order); the other
    images are on the CPU path already, and the device's refusals join them there."""

    def __init__(self, decoder: Decoder, spec: InputSpec, data: list[bytes], on_cpu: PendingDecode | None,
                 cpu_indices: list[int]) -> None:
        self.decoder, self.spec, self.data, self.on_cpu, self.cpu_indices = decoder, spec, data, on_cpu, cpu_indices

    def result(self) -> list[Row]:
        device = self.decoder.device_decoder
        assert device is not None
        rows: list[Row | None] = [None] * len(self.data)
        on_cpu = set(self.cpu_indices)
        planned = [i for i in range(len(self.data)) if i not in on_cpu]
        with self.decoder.device_context():
            decoded = device.decode_planned([self.data[i] for i in planned], self.spec)
            refused = [i for i, row in zip(planned, decoded, strict=True) if row is None]
            for i, row in zip(planned, decoded, strict=True):
                rows[i] = row
            cpu_rows: list[np.ndarray | BadImage] = self.on_cpu.result() if self.on_cpu is not None else []
            if refused:  # what nvJPEG refused: the CPU path, in the decoding processes
                cpu_rows = [*cpu_rows, *self.decoder.start_on_cpu([self.data[i] for i in refused], self.spec).result()]
            for i, cpu_row in zip([*self.cpu_indices, *refused], cpu_rows, strict=True):
                rows[i] = cpu_row if isinstance(cpu_row, BadImage) else torch.from_numpy(cpu_row).to(device.device)
        return [row for row in rows if row is not None]


class Decoder:
    """A batch's images decoded in order: on the intake thread while they are cheap, else one
    contiguous chunk per decoding process, so the intake can take the next batch off the list
    while they decode (a lone image never leaves the intake); with a device decoder, its JPEGs
    on the device (`DevicePendingDecode`)."""

    def __init__(self, processes: int, max_pixels: int, timeout_s: float | None = None, *,
                 device_decoder: DeviceJpegDecoder | None = None,
                 device_context: Callable[[], AbstractContextManager[None]] | None = None) -> None:
        self.max_pixels = max_pixels
        self.split = DecodeSplit(processes)
        self.processes = DecodeProcesses(processes, max_pixels, timeout_s)
        self.device_decoder = device_decoder
        self.device_context = device_context or _no_context

    def start(self, data: list[bytes], meta: ModelMeta) -> PendingDecode | DevicePendingDecode:
        spec = InputSpec.of(meta.preprocessing)
        if self.device_decoder is None:
            return self.start_on_cpu(data, spec)
        cpu_indices = [i for i, blob in enumerate(data) if device_jpeg_plan(blob, spec, self.max_pixels) is None]
        on_cpu = self.start_on_cpu([data[i] for i in cpu_indices], spec) if cpu_indices else None
        return DevicePendingDecode(self, spec, data, on_cpu, cpu_indices)

    def start_on_cpu(self, data: list[bytes], spec: InputSpec) -> PendingDecode:
        chunks = self.split.chunks(len(data))
        if chunks <= 1:
            chunk = decode_chunk(data, spec, self.max_pixels)
            self.split.observe(chunk.cpu_s, len(data))
            return PendingDecode(self, spec, [data], [], done=[chunk])
        size = -(-len(data) // chunks)
        parts = [data[i:i + size] for i in range(0, len(data), size)]
        return PendingDecode(self, spec, parts, [self.processes.submit(part, spec) for part in parts])

    def start_tensors(self, data: list[bytes], shapes: list[tuple[int, int, int] | None],
                      meta: ModelMeta) -> PendingDecode:
        """Preprocessed float32 rows (core/wire.py's "fp32" encoding): nothing to decode, each item
        read in place as one C×H×W row once its shape is the model's; one that is not is refused
        (422) for its own request. The API checks the shape too, against the job's record."""
        pre = meta.preprocessing
        wanted = (pre.channels, pre.height, pre.width)
        rows: list[np.ndarray | None] = []
        failures: list[tuple[int, str] | None] = []
        for item, shape in zip(data, shapes, strict=True):
            if shape != wanted or len(item) != 4 * pre.channels * pre.height * pre.width:
                rows.append(None)
                failures.append((422, f"a preprocessed input of shape {list(shape or ())} ({len(item)} bytes); "
                                      f"this model takes float32 {list(wanted)}"))
            else:
                rows.append(np.frombuffer(item, dtype="<f4").reshape(wanted))
                failures.append(None)
        chunk = Chunk(rows, failures, 0.0)  # type: ignore[arg-type]  # a list of rows, as ndarray's rows read
        return PendingDecode(self, InputSpec.of(pre), [data], [], done=[chunk])

    def decode_all(self, data: list[bytes], meta: ModelMeta) -> list[Row]:
        return list(self.start(data, meta).result())

    def shutdown(self) -> None:
        self.processes.shutdown()


def _no_context() -> AbstractContextManager[None]:
    import contextlib

    return contextlib.nullcontext()
