"""Image → model input. One implementation, used for training data and for /predict alike,
so a prediction sees exactly the evaluation transform the model was trained with."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image

from worker.checkpoint import Preprocessing


def image_to_array(image: Image.Image, channels: int, height: int, width: int) -> np.ndarray:
    """Decode to the architecture's channels and size: uint8 array C×H×W."""
    if getattr(image, "is_animated", False):
        image.seek(0)  # GIF/WebP animations: the first frame
    mode = "L" if channels == 1 else "RGB"
    if image.mode != mode:
        image = image.convert(mode)
    if image.size != (width, height):
        image = image.resize((width, height), Image.Resampling.BILINEAR)
    array = np.asarray(image, dtype=np.uint8)
    if array.ndim == 2:
        array = array[None, :, :]
    else:
        array = array.transpose(2, 0, 1)
    return np.ascontiguousarray(array)


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
