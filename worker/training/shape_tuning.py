"""An epoch's batches, the input shapes they give the model, and each shape tuned (run once on a twin
of the model) before the first epoch's clock starts.

On a GPU job `torch.backends.cudnn.benchmark` is on: the first time cuDNN sees a convolution
with a new input shape it times its candidate algorithms for it (forward, and for training both
backward passes), and CUDA loads each kernel the first time it is launched. Without tuning
first, all of that happens inside the first epoch, and is timed as its speed (docs/training.md).

Every distinct input shape an epoch uses (worker/training/trainer.py):

- training: `batch_bounds` gives batches of `batch_size` and one last shorter batch (the
  remainder, or `batch_size + 1` when the remainder is a single image); each step runs as
  `micro_batches` of at most the back-off's size (as even as possible, so a batch gives at most
  two pass sizes), forward and backward in training mode, then the optimizer step;
- validation: slices of the validation back-off's size and one last shorter slice, forward in
  eval mode under inference_mode.

So an epoch uses at most two training batches' passes and two validation shapes, all known
before the first step. After an out-of-memory back-off the passes shrink and the new shapes are
tuned when they first occur: that is rare, and the out-of-memory error costs more than a tune.

`tune_shapes` runs exactly those calls, the trainer's own step and validation, on a twin of the
model (`copy.deepcopy`), with a twin optimizer (same class, groups and state), a fresh gradient
scaler, zero images and labels, and a throwaway augmentation generator, inside
`torch.random.fork_rng`: the trained model's weights and BatchNorm statistics, its optimizer,
scaler and scheduler, and every random stream are untouched, so a job ends with bit-identical
weights with or without it (tests/worker/training/test_shape_tuning.py checks that on the CPU). The twin
needs memory of its own: when it does not fit, tuning stops at the out-of-memory error
(the job's back-off does not shrink for it) and the first epoch tunes what is left.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from worker.training.staging import Batches, ResidentBatches

log = logging.getLogger(__name__)

# (model, optimizer, scaler, images, labels, augmentation generator) → one optimizer step
Step = Callable[[nn.Module, torch.optim.Optimizer, torch.amp.GradScaler, torch.Tensor, torch.Tensor,
                 torch.Generator], object]
Validate = Callable[[nn.Module, Batches], object]


def batch_bounds(n: int, batch_size: int) -> list[tuple[int, int]]:
    """An epoch's batches: `batch_size` each, the last one shorter; a last batch of a single image
    joins the one before (BatchNorm cannot normalise a batch of one in training mode)."""
    bounds = [(begin, min(begin + batch_size, n)) for begin in range(0, n, batch_size)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        bounds[-2:] = [(bounds[-2][0], n)]
    return bounds


@dataclass(frozen=True)
class EpochShapes:
    sample: tuple[int, int, int]  # C×H×W of one image
    train_batches: tuple[int, ...]  # the distinct training batch sizes (each split as the step splits it)
    val_batches: tuple[int, ...]  # the distinct validation slice sizes, in the order measure() takes them


def epoch_shapes(sample: tuple[int, int, int], bounds: list[tuple[int, int]], n_val: int,
                 val_batch: int) -> EpochShapes:
    train = tuple(sorted({end - begin for begin, end in bounds}, reverse=True))
    val = tuple(dict.fromkeys(min(val_batch, n_val - begin) for begin in range(0, n_val, val_batch)))
    return EpochShapes(sample, train, val)


def tune_shapes(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, shapes: EpochShapes,
            *, step: Step, validate: Validate) -> None:
    """Run every shape of `shapes` through `step` and `validate` on twins of model and optimizer;
    returns once the device has finished, so none of it is timed as the first epoch's. `step` and
    `validate` must let torch.OutOfMemoryError through (no back-off: the twin's memory is the
    tuning's alone, and the job's back-off must not shrink for it); on one tuning ends, and
    the first epoch tunes what is left."""
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else None
    try:
        with torch.random.fork_rng(devices=[index] if cuda else [], device_type="cuda"):
            _run_on_twins(model, optimizer, scaler, shapes, device, step, validate)
    except torch.OutOfMemoryError as exc:
        log.warning("no shape tuning: the twin did not fit beside the model (%s); the first epoch tunes its shapes",
                    str(exc)[:200])
    if cuda:
        torch.cuda.synchronize(device)


def _run_on_twins(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                       shapes: EpochShapes, device: torch.device, step: Step, validate: Validate) -> None:
    twin = copy.deepcopy(model)
    twin_optimizer = _twin_optimizer(optimizer, model, twin)
    twin_scaler = torch.amp.GradScaler(device.type, enabled=scaler.is_enabled())
    generator = torch.Generator(device=device).manual_seed(0)
    for size in shapes.train_batches:
        images = torch.zeros((size, *shapes.sample), dtype=torch.uint8, device=device)
        twin.train()
        step(twin, twin_optimizer, twin_scaler, images, torch.zeros(size, dtype=torch.int64, device=device), generator)
    if shapes.val_batches:
        n = sum(shapes.val_batches)
        validate(twin, ResidentBatches(torch.zeros((n, *shapes.sample), dtype=torch.uint8, device=device),
                                       torch.zeros(n, dtype=torch.int64, device=device), device))


def _twin_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module, twin: nn.Module) -> torch.optim.Optimizer:
    """The optimizer's class over the twin's parameters, with the same groups and a copy of its state
    (a deep copy: load_state_dict keeps the tensors it is given when their device and dtype fit)."""
    twin_of = dict(zip(model.parameters(), twin.parameters(), strict=True))
    groups = [{"params": [twin_of[p] for p in group["params"]]} for group in optimizer.param_groups]
    build: Callable[[list[dict[str, Any]]], torch.optim.Optimizer] = type(optimizer)  # SGD, Adam, AdamW: (params)
    twin_optimizer = build(groups)
    twin_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    return twin_optimizer
