"""Image → model input. One implementation, used for training data and for /predict alike,
so a prediction sees exactly the evaluation transform the model was trained with.

The module imports no torch when it loads (torch only inside `stats_tensors`): the processes
that decode an uploaded dataset (worker/dataset_decode.py) import it, and each would otherwise
spend seconds and hundreds of megabytes importing torch before its first image.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

if TYPE_CHECKING:
    import torch

    from worker.checkpoint import Preprocessing

# Bumped whenever image_to_array's output changes for some input: datasets decoded by an older
# transform (worker/data.py's caches) are decoded again, so training data stays what /predict sees.
# 2: JPEG draft (below).
TRANSFORM_VERSION = 2

# JPEG decodes at 1/2, 1/4 or 1/8 scale (`Image.draft`) only while the scaled image keeps at least
# this many pixels per output pixel on both sides, and the resize after it maps the original's
# exact extent (draft's box): Pillow's own `thumbnail` default. This stays close to the full decode
# of the same files (docs/benchmarks.md, "Dataset decode"), where the smallest draft that covers the
# target, resized without the box, was visibly off.
DRAFT_REDUCING_GAP = 2


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


def normalize(batch: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """uint8 N×C×H×W → float, scaled to [0, 1] and standardised per channel (ToTensor + Normalize)."""
    return (batch.float().div_(255.0) - mean) / std


def stats_tensors(pre: Preprocessing, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    shape = (1, pre.channels, 1, 1)
    mean = torch.tensor(pre.mean, dtype=torch.float32, device=device).view(shape)
    std = torch.tensor(pre.std, dtype=torch.float32, device=device).view(shape)
    return mean, std


STATS_CHUNK_VALUES = 1 << 24  # values a chunk of channel_stats converts to float64 at a time (128 MB)


def channel_stats(images: torch.Tensor, index: torch.Tensor | None = None,
                  sample: int = 20_000) -> tuple[Sequence[float], Sequence[float]]:
    """Per-channel mean and (unbiased) std of uint8 images in [0, 1] units, over the first `sample`
    images of `index` (all of them when None).

    Chunk by chunk: each chunk's images are gathered and summed, with their squares, in float64,
    where sums of uint8 values and their squares are exact integers; mean and variance follow from
    the exact totals. The set is never copied whole (the trainer's split used to be gathered, then
    converted to float64 whole: eight bytes a value, seconds of allocation and page faults for a
    photo set), and the figures equal the whole-set float64 computation's to their rounding. The
    images may be on any device: the trainer passes its training split where it trains, so on a GPU
    the statistics take milliseconds."""
    import torch

    count = min(sample, len(images) if index is None else len(index))
    channels, values = images.shape[1], images[0].numel() if len(images) else 1
    per_chunk = max(1, STATS_CHUNK_VALUES // values)
    sums = torch.zeros(channels, dtype=torch.float64, device=images.device)
    squares = torch.zeros(channels, dtype=torch.float64, device=images.device)
    for begin in range(0, count, per_chunk):
        end = min(begin + per_chunk, count)
        chunk = (images[begin:end] if index is None else images[index[begin:end]]).flatten(2).double()
        sums += chunk.sum(dim=(0, 2))
        squares += chunk.mul_(chunk).sum(dim=(0, 2))
    n = count * (values // channels)  # values of one channel
    means, stds = [], []
    for total, total_squares in zip(sums.tolist(), squares.tolist(), strict=True):
        s, q = int(total), int(total_squares)
        variance = (n * q - s * s) / (n * (n - 1)) if n > 1 else 0.0  # exact integers, one rounding
        means.append(round(s / n / 255.0, 6) if n else float("nan"))
        stds.append(round(max(math.sqrt(variance) / 255.0, 1e-3), 6))
    return means, stds
