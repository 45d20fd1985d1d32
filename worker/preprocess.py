"""Image → model input. One implementation, used for training data and for /predict alike,
so a prediction sees exactly the evaluation transform the model was trained with."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image

from worker.checkpoint import Preprocessing


def image_to_array(image: Image.Image, channels: int, height: int, width: int,
                   resize_size: int | None = None) -> np.ndarray:
    """Decode to the architecture's channels and size: uint8 array C×H×W. With `resize_size` (the
    eval transform of pretrained weights): the shorter side resized to it, then a centre crop, as
    torchvision's Resize + CenterCrop do it."""
    if getattr(image, "is_animated", False):
        image.seek(0)  # GIF/WebP animations: the first frame
    mode = "L" if channels == 1 else "RGB"
    if image.mode != mode:
        image = image.convert(mode)
    if resize_size is not None:
        image = _resize_shorter_and_centre_crop(image, resize_size, height, width)
    elif image.size != (width, height):
        image = image.resize((width, height), Image.Resampling.BILINEAR)
    array = np.asarray(image, dtype=np.uint8)
    if array.ndim == 2:
        array = array[None, :, :]
    else:
        array = array.transpose(2, 0, 1)
    return np.ascontiguousarray(array)


def _resize_shorter_and_centre_crop(image: Image.Image, shorter: int, height: int, width: int) -> Image.Image:
    w, h = image.size
    if (w <= h and w != shorter) or (h < w and h != shorter):
        new = (shorter, int(shorter * h / w)) if w <= h else (int(shorter * w / h), shorter)
        image = image.resize(new, Image.Resampling.BILINEAR)
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
    shape = (1, pre.channels, 1, 1)
    mean = torch.tensor(pre.mean, dtype=torch.float32, device=device).view(shape)
    std = torch.tensor(pre.std, dtype=torch.float32, device=device).view(shape)
    return mean, std


def channel_stats(images: torch.Tensor, sample: int = 20_000) -> tuple[Sequence[float], Sequence[float]]:
    """Per-channel mean and std of uint8 images in [0, 1] units (over a sample for big sets)."""
    subset = images[: min(sample, len(images))].double().div_(255.0)
    mean = subset.mean(dim=(0, 2, 3))
    std = subset.std(dim=(0, 2, 3)).clamp_min(1e-3)
    return [round(float(v), 6) for v in mean], [round(float(v), 6) for v in std]
