"""A JPEG → the model's input (uint8 C×H×W) with torchvision's CPU decoder and torch's uint8 resize.

Why: on a 500×375 photo to 224×224 Pillow's decode costs about as much as torchvision's (the same
libjpeg-turbo, bit-identical pixels) but Pillow's bilinear resize costs 1.3 ms, torch's antialiased
uint8 resize (vectorised) about 0.25 ms: the whole image → input runs about 2× as fast, and a 32×32
JPEG 3× (docs/benchmarks.md, "CPU JPEG decoders"). torch's antialiased bilinear resize of uint8 is
written after Pillow's, so the output is the preprocessing contract's (Pillow's BILINEAR,
docs/deploying-models.md) within one uint8 level (tests/worker/data/test_torch_jpeg.py).

Which files come here is decided before this module is imported (worker/data/image_array.py,
`fast_jpeg_plan`): a JPEG whose header says 8 bits, one or three components, Huffman coding, a size
within the pixel limit, and a target for which Pillow's scaled decoding (`draft`) would not shrink
the decode (where it does, Pillow decodes 4-64× fewer pixels and stays). Anything the decoder
refuses (a truncated or corrupt file: a RuntimeError) returns None, and the caller decodes it
with Pillow, which refuses it with the 415 it always did.

This module imports torch and torchvision: the worker has them already (its intake thread decodes
cheap images itself), a batch prediction's DataLoader processes too; a /predict decoding process
imports them on a thread from its first such JPEG, once for its life (the pool lives as long as the
worker), decoding with Pillow until then (worker/data/image_array._torch_jpeg: `READY`, last here). The
worker's forkserver does not preload them: that cost every worker's start seconds of CPU, enough
on a loaded 2-core host to miss a first request's timeout (docs/benchmarks.md, "CPU JPEG
decoders"). Training data stays with Pillow (worker/data/dataset_decode.py), within JPEG_TOLERANCE.
Each thread that decodes here runs its torch ops on itself alone (`_one_thread`): a resize must
never start an OpenMP team per decoding process.
"""

from __future__ import annotations

import threading
import warnings

import numpy as np
import torch
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms.v2 import functional as F

# torchvision 0.29 deprecates its image decoders in favour of TorchCodec, with a warning on every
# call. They are what the issue asked for (no new dependency) and what this host measured; the
# day they are removed, this import fails in the tests (tests/worker/data/test_torch_jpeg.py) and
# TorchCodec's decode_jpeg takes their place. Silenced so that no decode pays for the warning.
warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of TorchVision",
                        category=DeprecationWarning)

_pinned = threading.local()


def _one_thread() -> None:
    """torch ops of this thread on this thread (as worker/device/cpu_threads.pin_to_one_thread,
    which this module cannot import: it is loaded into the torch-free decoding processes' server)."""
    if not getattr(_pinned, "done", False):
        torch.get_num_threads()  # torch sets a thread's count lazily: read it before setting it
        torch.set_num_threads(1)
        _pinned.done = True


def decode(data: bytes | memoryview, channels: int, height: int, width: int,
           resized: tuple[int, int], crop: bool) -> np.ndarray | None:
    """`data` decoded (gray or RGB), resized to `resized` (width, height) with antialiased
    bilinear filtering unless it has that size, then centre-cropped to height × width when `crop`;
    None when the decoder refuses the file."""
    _one_thread()
    try:
        image = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8),
                            mode=ImageReadMode.GRAY if channels == 1 else ImageReadMode.RGB)
    except RuntimeError:  # truncated, corrupt: Pillow says why (415)
        return None
    if (image.shape[2], image.shape[1]) != resized:
        image = F.resize(image, [resized[1], resized[0]], interpolation=F.InterpolationMode.BILINEAR,
                         antialias=True)
    if crop:
        h, w = image.shape[1], image.shape[2]
        top, left = round((h - height) / 2.0), round((w - width) / 2.0)
        image = image[:, top:top + height, left:left + width]
    return np.ascontiguousarray(image.numpy())


READY = True  # the module is whole: image_array._torch_jpeg uses it only from here on (an import on a thread)
