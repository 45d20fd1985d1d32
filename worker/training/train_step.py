"""One optimizer step of the training loop, and where it runs: one device, or one rank of a gang.

`StepRunner.step` runs a batch as micro-batches of `backoff.size` images whose gradients
accumulate into one optimizer step; on a CUDA out-of-memory error the step starts over with
smaller ones (worker/training/backoff.py). What differs between a job on one device and a rank of a
data-parallel job is its `Placement` (`OneDevice` here; `GangPlacement` in worker/gang/collectives.py):
which images of each batch this process computes, how much its loss weighs in the step, the
augmentation draws, the sums reduced across ranks, and whether it writes the job's files.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import nn

from worker.data.normalization import normalize
from worker.training.augment import random_crop_flip
from worker.training.backoff import BatchBackoff
from worker.training.evaluation import Measured


class Placement(Protocol):
    """Where the trainer's computation runs (see the module docstring)."""

    leader: bool  # writes the checkpoints (and, through the reporter, the job's state)

    def wrap(self, model: nn.Module) -> nn.Module: ...
    def shard(self, index: torch.Tensor) -> torch.Tensor: ...
    def weight(self, images: int, local: int) -> float: ...
    def augment(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor: ...
    def reduce_sums(self, loss_sum: torch.Tensor, correct: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
    def reduce_measured(self, measured: Measured | None, num_classes: int) -> Measured | None: ...
    def backoff(self, size: int, what: str, notify: Callable[[str, dict[str, Any]], None],
                release: Callable[[], None]) -> BatchBackoff: ...


class OneDevice:
    """A job on one device: every image of every batch, nothing to reduce."""

    leader = True

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def shard(self, index: torch.Tensor) -> torch.Tensor:
        return index

    def weight(self, images: int, local: int) -> float:
        """A pass of `images` of the step's `local` images: its share of the step's mean loss."""
        return images / local

    def augment(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return random_crop_flip(images, generator)

    def reduce_sums(self, loss_sum: torch.Tensor, correct: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return loss_sum, correct

    def reduce_measured(self, measured: Measured | None, num_classes: int) -> Measured | None:
        return measured

    def backoff(self, size: int, what: str, notify: Callable[[str, dict[str, Any]], None],
                release: Callable[[], None]) -> BatchBackoff:
        return BatchBackoff(size, what, notify=notify, release=release)


def micro_batches(total: int, size: int) -> Iterator[tuple[int, int]]:
    """`total` images in passes of at most `size`, as even as possible (never a stray pass of one).
    No image (a gang's rank whose share of a short last batch is empty): one empty pass, so the rank
    still takes part in the step's collectives."""
    if total == 0:
        yield 0, 0
        return
    passes = -(-total // max(1, size))
    per_pass = -(-total // passes)
    for begin in range(0, total, per_pass):
        yield begin, min(begin + per_pass, total)


class StepRunner:
    def __init__(self, device: torch.device, placement: Placement, *, augment: bool, channels_last: bool,
                 autocast: Callable[[], contextlib.AbstractContextManager], one_image_split: bool = False) -> None:
        """`one_image_split`: the whole train split is one image (the trainer merges a last batch of one
        into the batch before, so no other step holds one): BatchNorm cannot normalise a batch of one
        in training mode, so that image goes through twice (the same mean loss and gradient), after its
        augmentation, and counts once."""
        self.one_image_split = one_image_split
        self.device = device
        self.placement = placement
        self.augment = augment
        self.channels_last = channels_last
        self.autocast = autocast

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
             loss_fn: nn.Module, x: torch.Tensor, y: torch.Tensor, aug_gen: torch.Generator, mean: torch.Tensor,
             std: torch.Tensor, backoff: BatchBackoff) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over the batch: (summed loss, correct predictions) of this process's images."""
        while True:
            error = None
            try:
                result = self.accumulate(model, optimizer, scaler, loss_fn, x, y, aug_gen, mean, std, backoff.size)
                backoff.succeeded()
                return result
            except torch.OutOfMemoryError as exc:
                error = str(exc)
            # Outside the except clause: its traceback (and the failed pass's tensors) is released.
            optimizer.zero_grad(set_to_none=True)
            backoff.out_of_memory(error)

    def accumulate(self, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                    loss_fn: nn.Module, x: torch.Tensor, y: torch.Tensor, aug_gen: torch.Generator,
                    mean: torch.Tensor, std: torch.Tensor, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device)
        correct = torch.zeros((), device=self.device, dtype=torch.int64)
        total = len(y)
        scaled = scaler.is_enabled()
        for begin, end in micro_batches(total, micro):
            xb, yb = x[begin:end], y[begin:end]
            if self.augment:
                xb = self.placement.augment(xb, aug_gen)
            if self.one_image_split and end - begin == 1:
                xb, yb = xb.repeat(2, 1, 1, 1), yb.repeat(2)
            xb = normalize(xb, mean, std)
            if self.channels_last:
                xb = xb.contiguous(memory_format=torch.channels_last)
            with self.autocast():
                logits = model(xb)
                loss = loss_fn(logits.float(), yb)
            if end == begin:  # no image here: a zero that still carries the graph (and the collectives)
                share = logits.float().sum()
            else:
                weight = self.placement.weight(end - begin, total)
                share = loss if weight == 1.0 else loss * weight
                loss_sum += loss.detach() * (end - begin)
                correct += (logits[: end - begin].argmax(1) == yb[: end - begin]).sum()
            (scaler.scale(share) if scaled else share).backward()
        if scaled:
            scaler.step(optimizer)
            scaler.update()
        else:  # what a disabled scaler would do, without its per-step Python (the CPU's path)
            optimizer.step()
        return loss_sum, correct
