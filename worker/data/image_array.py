"""An image → the model's input array (uint8 C×H×W): the one transform every path shares.

Training data (an upload decoded by worker/data/dataset_decode.py, a built-in set by
worker/data/datasets.py), /predict (worker/serving/decode_processes.py) and a batch prediction
(worker/data/batch_predict_loader.py) all turn an image into input here, so a prediction sees
exactly the evaluation transform the model was trained with, and a batch prediction's line is
/predict's answer for the same file. `decode_image` is the bytes' way in (the format allowlist of
core/images.py, the pixel limit, every failure a `BadImage` with the HTTP status it becomes);
`image_to_array` the transform of an opened image (the checkpoint's channels and size, the
shorter-side resize and centre crop of pretrained weights, libjpeg's scaled decoding for JPEG).
A JPEG that Pillow would decode at full scale goes to torchvision's decoder and torch's uint8 resize
instead (`fast_jpeg_plan`, worker/data/torch_jpeg.py): about half the CPU for a photo to 224 and for
a small JPEG (docs/benchmarks.md, "CPU JPEG decoders"), within one uint8 level of Pillow's output
(the contract's tolerance, JPEG_TOLERANCE).

The module imports no torch itself (worker/data/torch_jpeg.py does): an upload's decoding processes,
which run `image_to_array` on opened files, never import it, and a /predict decoding process starts
importing it on a thread at its first such JPEG, decoding with Pillow until it is in (`_torch_jpeg`;
the worker's forkserver stays light: preloading torch there cost a worker's start seconds of CPU,
docs/benchmarks.md).
Normalisation (the float side) is worker/data/normalization.py.
"""

from __future__ import annotations

import importlib
import io
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from core.image_headers import read_header
from core.images import IMAGE_FORMATS

if TYPE_CHECKING:
    from worker.checkpoints.format import Preprocessing

# Bumped whenever image_to_array's output changes for some input: datasets decoded by an older
# transform (worker/data/datasets.py's caches) are decoded again, so training data stays what /predict sees.
# 2: JPEG draft (below). Training data is decoded by Pillow (worker/data/dataset_decode.py), and on a
# CUDA worker its baseline JPEGs by nvJPEG (worker/data/device_dataset_decode.py): torchvision's JPEG
# decoders (fast_jpeg_array, nvJPEG) are within JPEG_TOLERANCE of Pillow, so they share this version.
TRANSFORM_VERSION = 2

# What the two decoders of a JPEG may differ by, in uint8 levels, against the preprocessing
# contract (Pillow's decode + BILINEAR resize, docs/deploying-models.md): the pixels decoded are
# the same (one libjpeg-turbo), torch's antialiased uint8 resize rounds a few outputs the other way.
# Measured: max 1; mean 0.002 on photos, 0.04 on a 48×40 image to 32×32 (docs/benchmarks.md, "CPU JPEG decoders").
JPEG_TOLERANCE_MAX = 1
JPEG_TOLERANCE_MEAN = 0.1

# JPEG decodes at 1/2, 1/4 or 1/8 scale (`Image.draft`) only while the scaled image keeps at least
# this many pixels per output pixel on both sides, and the resize after it maps the original's
# exact extent (draft's box): Pillow's own `thumbnail` default. This stays close to the full decode
# of the same files (docs/benchmarks.md, "Dataset decode"), where the smallest draft that covers the
# target, resized without the box, was visibly off.
DRAFT_REDUCING_GAP = 2


@dataclass(frozen=True)
class InputSpec:
    """What a model takes: channels, height, width, and the shorter-side resize before a centre
    crop (pretrained weights' eval transform), or None for a plain resize."""

    channels: int
    height: int
    width: int
    resize_size: int | None = None

    @classmethod
    def of(cls, pre: Preprocessing) -> InputSpec:
        """The input a checkpoint's recorded preprocessing asks for."""
        return cls(pre.channels, pre.height, pre.width, pre.resize_size)

    @property
    def name(self) -> str:
        return f"{self.channels}x{self.height}x{self.width}" + (f"r{self.resize_size}" if self.resize_size else "")

    def empty(self, n: int) -> np.ndarray:
        return np.empty((n, self.channels, self.height, self.width), dtype=np.uint8)


class BadImage(ValueError):
    """What cannot be a model's input: 413 (too many pixels) or 415 (not an image we decode); the
    message says why, for the client."""

    def __init__(self, detail: str, status: int = 415) -> None:
        super().__init__(detail)
        self.detail, self.status = detail, status


def decode_image(data: bytes, spec: InputSpec, max_pixels: int) -> np.ndarray:
    """Bytes → C×H×W uint8 at `spec`; any failure is a BadImage. Only the allowlisted formats are
    tried (core/images.py), and Pillow's decoders raise Python errors on corrupt or truncated data.
    A JPEG that `fast_jpeg_plan` gives to torchvision is decoded there (its pixel limit checked on
    its header first); one that decoder refuses is decoded, or refused, by Pillow."""
    array = fast_jpeg_array(data, spec, max_pixels)
    if array is not None:
        return array
    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as image:
            if image.width * image.height > max_pixels:
                raise BadImage(f"image has {image.width * image.height} pixels, over the limit of {max_pixels}", 413)
            return image_to_array(image, spec.channels, spec.height, spec.width, spec.resize_size)
    except BadImage:
        raise
    except Image.DecompressionBombError:
        raise BadImage(f"image has too many pixels; the limit is {max_pixels}", 413) from None
    except Exception as exc:  # truncated, not an image, corrupt palette, ...
        raise BadImage(f"cannot decode image: {exc}") from exc


def fast_jpeg_array(data: bytes | memoryview, spec: InputSpec, max_pixels: int) -> np.ndarray | None:
    """`data` at `spec` through torchvision's decoder when `fast_jpeg_plan` gives it there, else None
    (Pillow's turn: not such a JPEG, or one that decoder refused). Over the limit: BadImage 413."""
    plan = fast_jpeg_plan(data, spec, max_pixels)
    if plan is None:
        return None
    torch_jpeg = _torch_jpeg()
    if torch_jpeg is None:
        return None  # still importing: Pillow meanwhile
    return torch_jpeg.decode(data, spec.channels, spec.height, spec.width, *plan)


_importing: list[threading.Thread] = []


def _torch_jpeg() -> Any:
    """worker/data/torch_jpeg.py once this process has imported it; until then None, and the import
    started on a thread of its own (at the first JPEG that would go there). A decoding process never
    waits seconds for torch mid-batch (its chunk's timeout counts), nor does a worker's start pay
    for it: its first JPEGs decode with Pillow, the rest with torchvision, within JPEG_TOLERANCE."""
    module = sys.modules.get("worker.data.torch_jpeg")
    if module is not None and getattr(module, "READY", False):
        return module
    if not _importing:
        _importing.append(threading.Thread(target=importlib.import_module, args=("worker.data.torch_jpeg",),
                                           name="torch-jpeg-import", daemon=True))
        _importing[0].start()
    return None


def fast_jpeg_plan(data: bytes | memoryview, spec: InputSpec, max_pixels: int) -> tuple[tuple[int, int], bool] | None:
    """For a JPEG that torchvision's CPU decoder takes where it pays: the size to resize to
    (width, height) and whether a centre crop follows; None for Pillow. Over the pixel limit by
    its header: BadImage 413 before any decode, as Pillow's lazy open refuses it.

    torchvision takes 8-bit Huffman-coded JPEGs of 1 or 3 components (CMYK, 12-bit, arithmetic
    coding stay with Pillow, which decodes or refuses them as before) that Pillow's `draft` would
    decode at full scale: where draft shrinks the decode (a photo to 32×32), Pillow decodes 4-64×
    fewer pixels and is faster (docs/benchmarks.md, "CPU JPEG decoders"). A crop that would need
    padding stays with Pillow too."""
    header = read_header(data)
    if header is None:
        return None
    if header.width * header.height > max_pixels:
        raise BadImage(f"image has {header.width * header.height} pixels, over the limit of {max_pixels}", 413)
    if header.precision != 8 or header.components not in (1, 3) or not header.huffman or spec.channels not in (1, 3):
        return None
    size = (header.width, header.height)
    resized = (spec.width, spec.height) if spec.resize_size is None else _shorter_side_size(size, spec.resize_size)
    if min(size[0] // (resized[0] * DRAFT_REDUCING_GAP), size[1] // (resized[1] * DRAFT_REDUCING_GAP)) >= 2:
        return None  # Pillow's draft decodes at 1/2 or less (`_draft`, Pillow's JpegImageFile.draft)
    if spec.resize_size is not None and (resized[0] < spec.width or resized[1] < spec.height):
        return None
    return resized, spec.resize_size is not None


def image_to_array(image: Image.Image, channels: int, height: int, width: int,
                   resize_size: int | None = None) -> np.ndarray:
    """Decode to the architecture's channels and size: uint8 array C×H×W. With `resize_size` (the
    eval transform of pretrained weights): the shorter side resized to it, then a centre crop, as
    torchvision's Resize + CenterCrop do it.

    A JPEG not yet loaded is decoded by libjpeg at the smallest of 1/8, 1/4, 1/2 scale that keeps
    DRAFT_REDUCING_GAP times the size the resize goes to (`Image.draft`): most of a large photo's
    cost is decoding pixels the resize would average away. Other formats decode in full."""
    if getattr(image, "is_animated", False):
        image.seek(0)  # GIF/WebP animations: the first frame
    mode = "L" if channels == 1 else "RGB"
    resized = (width, height) if resize_size is None else _shorter_side_size(image.size, resize_size)
    box = _draft(image, mode, resized)
    if image.mode != mode:
        image = image.convert(mode)
    if image.size != resized or box is not None:
        image = image.resize(resized, Image.Resampling.BILINEAR, box=box)
    if resize_size is not None:
        image = _centre_crop(image, height, width)
    array = np.asarray(image, dtype=np.uint8)
    if array.ndim == 2:
        array = array[None, :, :]
    else:
        array = array.transpose(2, 0, 1)
    return np.ascontiguousarray(array)


def _draft(image: Image.Image, mode: str, size: tuple[int, int]) -> tuple[float, float, float, float] | None:
    """Ask the JPEG decoder for a reduced image; the original's extent in it (for `resize(box=)`),
    or None when it is not reduced. Pillow ignores the request for other formats and for an image
    already loaded; a JPEG of mode RGB asked for "L" decodes its luma alone."""
    drafted = image.draft(mode, (size[0] * DRAFT_REDUCING_GAP, size[1] * DRAFT_REDUCING_GAP))
    if drafted is None:
        return None
    box = drafted[1]
    return None if (box[2], box[3]) == image.size else box


def _shorter_side_size(size: tuple[int, int], shorter: int) -> tuple[int, int]:
    """The size torchvision's Resize(shorter) gives an image of `size` (width, height)."""
    w, h = size
    if w <= h:
        return (w, h) if w == shorter else (shorter, int(shorter * h / w))
    return (w, h) if h == shorter else (int(shorter * w / h), shorter)


def _centre_crop(image: Image.Image, height: int, width: int) -> Image.Image:
    w, h = image.size
    top, left = round((h - height) / 2.0), round((w - width) / 2.0)
    return image.crop((left, top, left + width, top + height))  # PIL pads with black where it must


def apply_preprocessing(image: Image.Image, pre: Preprocessing) -> np.ndarray:
    """An image as the checkpoint's recorded preprocessing turns it into input (before normalising)."""
    return image_to_array(image, pre.channels, pre.height, pre.width, pre.resize_size)
