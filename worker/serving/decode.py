"""The decode stage: image bytes → the model's input (uint8 C×H×W), spread over the worker's cores.

Decoding is most of the CPU a prediction costs on a fast device, so it never runs on the thread
that feeds the device, and it uses the cores the worker is given: a pool of threads, since
Pillow releases the GIL inside its decoders and resampling, which is where a photo's time goes
(bench/decode_gil.py measures how much of an image's decode holds the GIL, hence how many
threads can run in parallel; docs/benchmarks.md). Images are decoded at the size the model needs
(worker/preprocess.py: libjpeg's scaled decoding through `Image.draft` for JPEG), with the
checkpoint's preprocessing, the training evaluation transform.

A small image is another matter: its decode is mostly Python holding the GIL, so threads would
mostly wait for each other; `DecodeSplit` keeps such images on the calling thread alone.
"""

from __future__ import annotations

import io
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from PIL import Image

from core.images import IMAGE_FORMATS
from worker.checkpoint import ModelMeta
from worker.cpu_threads import pin_to_one_thread
from worker.preprocess import apply_preprocessing


class BadImage(Exception):
    """An upload the worker cannot turn into an input: 415, or 413 when it is too many pixels."""

    def __init__(self, detail: str, status: int = 415) -> None:
        super().__init__(detail)
        self.status = status


def decode_image(data: bytes, meta: ModelMeta, max_pixels: int) -> np.ndarray:
    """Bytes → C×H×W uint8 with the model's recorded preprocessing; any failure is a BadImage.
    Pillow's decoders raise Python errors on corrupt or truncated data (they do not crash the
    process), and only the allowlisted formats are tried (core/images.py)."""
    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as image:
            if image.width * image.height > max_pixels:
                raise BadImage(f"image has {image.width * image.height} pixels, over the limit of {max_pixels}", 413)
            return apply_preprocessing(image, meta.preprocessing)
    except BadImage:
        raise
    except Image.DecompressionBombError:
        raise BadImage(f"image has too many pixels; the limit is {max_pixels}", 413) from None
    except Exception as exc:  # truncated, not an image, corrupt palette, ...
        raise BadImage(f"cannot decode image: {exc}") from exc


class DecodeSplit:
    """Over how many threads a batch's images are decoded: one while they are cheap, the pool once
    they are not.

    Pillow releases the GIL only inside its decoder, and a small image is mostly Python around
    that call, so two threads decoding small images mostly wait for each other, while a photo is
    mostly the decoder. The encoded size does not tell them apart (a small PNG of noise is a large
    file and cheap to decode), so the calling thread times its own share in CPU time (which waits
    for the GIL do not inflate) and the split follows a running average of that."""

    POOL_FROM_S = 60e-6  # an image's decode CPU from which the pool pays (docs/benchmarks.md)
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
    """A batch's images decoded in order: one contiguous chunk per thread, the last on the calling
    thread while the pool does the others (a lone image never changes threads; a task per image
    would cost more in hand-offs than a small image's decode)."""

    def __init__(self, threads: int, max_pixels: int) -> None:
        self.max_pixels = max_pixels
        self.split = DecodeSplit(threads)
        # `threads` chunks: the calling thread's and the pool's. The pool's threads also send replies
        # (worker/serving/replies.py), hence one more; torch ops there (top-k) must not start an
        # OpenMP team of their own (worker/cpu_threads.py).
        self.pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="torchyard-decode",
                                       initializer=pin_to_one_thread)

    def decode_all(self, data: list[bytes], meta: ModelMeta) -> list[np.ndarray | BadImage]:
        chunks = self.split.chunks(len(data))
        size = -(-len(data) // chunks)
        parts = [data[i:i + size] for i in range(0, len(data), size)]
        pending = [self.pool.submit(self._decode_chunk, part, meta) for part in parts[:-1]]
        began = time.thread_time()
        last = self._decode_chunk(parts[-1], meta)
        self.split.observe(time.thread_time() - began, len(parts[-1]))
        return [d for future in pending for d in future.result()] + last

    def _decode_chunk(self, data: list[bytes], meta: ModelMeta) -> list[np.ndarray | BadImage]:
        decoded: list[np.ndarray | BadImage] = []
        for one in data:
            try:
                decoded.append(decode_image(one, meta, self.max_pixels))
            except BadImage as exc:
                decoded.append(exc)
        return decoded

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
