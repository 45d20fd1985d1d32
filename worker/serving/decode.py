"""The decode stage: image bytes → the model's input (uint8 C×H×W), spread over the worker's cores.

Decoding is most of the CPU a prediction costs on a fast device, so it never runs on the thread
that feeds the device, and it uses the cores the worker is given: a batch's images are split
into chunks, decoded by processes of their own (worker/serving/decode_processes.py: a photo's
decode holds the GIL for too large a share for threads to scale) while the intake thread decodes
the last chunk itself. Images are decoded at the size the model needs (worker/preprocess.py:
libjpeg's scaled decoding through `Image.draft` for JPEG), with the checkpoint's preprocessing,
the training evaluation transform.

A small image is another matter: its decode costs less than sending it to a process and its
array back, so `DecodeSplit` keeps such images on the intake thread alone.
"""

from __future__ import annotations

import time

import numpy as np

from worker.checkpoint import ModelMeta
from worker.serving.decode_processes import DecodeProcesses, Refused, Spec, decode_chunk, decode_one


class BadImage(Exception):
    """An upload the worker cannot turn into an input: 415, or 413 when it is too many pixels."""

    def __init__(self, detail: str, status: int = 415) -> None:
        super().__init__(detail)
        self.status = status


def decode_image(data: bytes, meta: ModelMeta, max_pixels: int) -> np.ndarray:
    """Bytes → C×H×W uint8 with the model's recorded preprocessing; any failure is a BadImage.
    Pillow's decoders raise Python errors on corrupt or truncated data, and only the allowlisted
    formats are tried (core/images.py)."""
    try:
        return decode_one(data, spec_of(meta), max_pixels)
    except Refused as refused:
        raise BadImage(refused.detail, refused.status) from refused


def spec_of(meta: ModelMeta) -> Spec:
    pre = meta.preprocessing
    return pre.channels, pre.height, pre.width, pre.resize_size


class DecodeSplit:
    """Over how many chunks a batch's images are decoded: one (the intake thread's) while they are
    cheap, one per core once they are not.

    A small image decodes in less than its trip to a decoding process and back costs, while a
    photo is mostly the decoder's work. The encoded size does not tell them apart (a small PNG of
    noise is a large file and cheap to decode), so the intake thread times its own share in CPU
    time and the split follows a running average of that."""

    POOL_FROM_S = 120e-6  # an image's decode CPU from which the processes pay (bench/decode_split.py)
    WEIGHT = 0.2  # of the newest batch in the running average

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self.image_s: float | None = None  # running average of one image's decode CPU, once measured

    def chunks(self, images: int) -> int:
        """How many chunks (threads) a batch of `images` is decoded in."""
        if images <= 1 or self.image_s is None or self.image_s < self.POOL_FROM_S:
            return 1
        return min(self.threads, images)

    def observe(self, cpu_s: float, images: int) -> None:
        """The calling thread's share of a batch: `images` decoded in `cpu_s` of its CPU time."""
        if images <= 0:
            return
        one = cpu_s / images
        self.image_s = one if self.image_s is None else self.image_s + self.WEIGHT * (one - self.image_s)


class Decoder:
    """A batch's images decoded in order: one contiguous chunk per core, the last on the calling
    thread while the decoding processes do the others (a lone image never leaves the intake)."""

    def __init__(self, cores: int, max_pixels: int) -> None:
        self.max_pixels = max_pixels
        self.split = DecodeSplit(cores)
        self.processes = DecodeProcesses(max(1, cores - 1), max_pixels)

    def decode_all(self, data: list[bytes], meta: ModelMeta) -> list[np.ndarray | BadImage]:
        spec = spec_of(meta)
        chunks = self.split.chunks(len(data))
        size = -(-len(data) // chunks)
        parts = [data[i:i + size] for i in range(0, len(data), size)]
        pending = [self.processes.submit(part, spec) for part in parts[:-1]]
        began = time.thread_time()
        mine = decode_chunk(parts[-1], spec, self.max_pixels)
        self.split.observe(time.thread_time() - began, len(parts[-1]))
        decoded: list[np.ndarray | BadImage] = []
        for rows, failures in [*self.processes.gather(parts[:-1], pending, spec), mine]:
            for row, failure in zip(rows, failures, strict=True):
                decoded.append(row if failure is None else BadImage(failure[1], failure[0]))
        return decoded

    def shutdown(self) -> None:
        self.processes.shutdown()
