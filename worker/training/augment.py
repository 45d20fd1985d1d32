"""Augmentation per image, on the device the batch is on: a random crop with reflected padding and
a random horizontal flip, each drawn for every sample.

Both are one `gather` over the uint8 batch: each output pixel reads the source pixel its image's
offset (and flip) maps it to, with indices reflected at the border (what padding with
`mode="reflect"` and cropping would read). Offsets and flips are drawn on the batch's device from
the caller's generator, so nothing comes back to the host: no sync per step on a GPU (the first
version drew one offset per batch on the CPU for that reason, so every image of a batch moved
alike).
"""

from __future__ import annotations

import torch

PAD = 4  # pixels of (reflected) padding around a crop: the CIFAR recipe's RandomCrop(32, padding=4)


def random_crop_flip(images: torch.Tensor, generator: torch.Generator, pad: int = PAD) -> torch.Tensor:
    """N×C×H×W (any dtype) → the same shape, each image shifted by its own (dy, dx) in [-pad, pad]
    with reflected borders and flipped left-right with probability 1/2."""
    if len(images) == 0:
        return images
    shifts, flips = crop_flip_draws(len(images), images.shape[2], images.shape[3], generator, images.device, pad)
    return apply_crop_flip(images, shifts, flips)


def crop_flip_draws(n: int, h: int, w: int, generator: torch.Generator, device: torch.device,
                    pad: int = PAD) -> tuple[torch.Tensor, torch.Tensor]:
    """The random part of `random_crop_flip` for `n` images: (N×2 shifts, N×1 flips). A gang's rank
    draws them for the whole global batch, the same on every rank, and applies its own rows."""
    pad = min(pad, h - 1, w - 1)  # a reflection cannot reach further than the image
    shifts = torch.randint(-pad, pad + 1, (n, 2), device=device, generator=generator)
    flips = torch.randint(0, 2, (n, 1), device=device, generator=generator).bool()
    return shifts, flips


def apply_crop_flip(images: torch.Tensor, shifts: torch.Tensor, flips: torch.Tensor) -> torch.Tensor:
    """Shift and flip each image as drawn (one gather)."""
    n, c, h, w = images.shape
    if n == 0:
        return images
    device = images.device
    rows = _reflect(torch.arange(h, device=device) + shifts[:, :1], h)  # N×H
    across = torch.arange(w, device=device)
    cols = _reflect(torch.where(flips, (w - 1) - across, across) + shifts[:, 1:], w)  # N×W
    index = (rows[:, :, None] * w + cols[:, None, :]).reshape(n, 1, h * w).expand(n, c, h * w)
    return images.reshape(n, c, h * w).gather(2, index).view(n, c, h, w)


def _reflect(index: torch.Tensor, size: int) -> torch.Tensor:
    """Reflect indices that fall outside [0, size) back in, without repeating the edge pixel."""
    index = index.abs()
    return torch.where(index > size - 1, 2 * (size - 1) - index, index)
