"""Normalisation, the float side of an input: uint8 batches scaled and standardised per channel with
the checkpoint's mean and std, and those statistics measured on a training split.

Training (worker/training/), evaluation (worker/kinds/evaluate.py) and the benches use it; /predict
and batch predictions run the same arithmetic inside their traced graph
(worker/checkpoints/forward_graph.py). torch is imported inside the functions only: the module is
imported beside the image transform by processes that never load torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from worker.checkpoints.format import Preprocessing


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
