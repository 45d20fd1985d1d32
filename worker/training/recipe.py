"""The training recipe's decisions that are not the loop itself: mixed precision per device, the
optimizer with its weight decay, the learning-rate schedule, and which epoch is best (early
stopping). Each is a plain function or object the CPU tests exercise in full; the only CUDA
calls they lead to are listed in docs/gpu.md.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.optim import lr_scheduler

# ---------------------------------------------------------------------------- mixed precision


@dataclass(frozen=True)
class Precision:
    amp_dtype: Literal["bfloat16", "float16"] | None  # autocast's dtype; None: full fp32
    grad_scaler: bool  # fp16 needs a gradient scaler (its range is narrow); bf16 does not
    channels_last: bool  # NHWC: the layout tensor cores and oneDNN's bf16 convolutions are fastest in


# /proc/cpuinfo flags of a CPU that multiplies bf16 in hardware: AVX512-BF16's dot products, AMX's tiles.
NATIVE_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def choose_precision(device_type: str, capability: tuple[int, int] | None,
                     cpu_flags: Collection[str] = (), mixed: bool = True) -> Precision:
    """Mixed precision only where the device runs it natively (and only when `mixed`: a job's
    `"precision": "fp32"` asks for none; a GPU keeps channels_last, a CPU NCHW).

    - CUDA compute capability 8.0 and newer (Ampere, Hopper, ...): bf16 autocast, no scaler.
    - 7.x (Volta, Turing): fp16 autocast with a GradScaler. Their tensor cores run fp16; Turing
      reports bf16 as supported (`torch.cuda.is_bf16_supported()` counts emulation), but emulated
      bf16 is slower than fp32, so the capability decides, not that call.
    - older GPUs (no tensor cores): none. Every GPU keeps channels_last.
    - a CPU whose flags (`cpu_flags`, /proc/cpuinfo's) say it multiplies bf16 in hardware: bf16
      autocast in channels_last. oneDNN's bf16 convolutions run in NHWC; in the default NCHW
      layout the reorders around them cost the small model (cifar_net) what the arithmetic saved.
      On this repository's AMD EPYC (avx512_bf16) bf16 in channels_last trained both cifar_net and
      resnet18 faster than fp32 in either layout, at the same accuracy on the built-in sets
      (docs/training.md, "Mixed precision on a CPU").
    - any other CPU: fp32, NCHW. bf16 there is converted in software, and nothing was measured.
    """
    if not mixed:
        return Precision(None, False, device_type == "cuda")
    if device_type != "cuda" or capability is None:
        if device_type == "cpu" and NATIVE_BF16_CPU_FLAGS & set(cpu_flags):
            return Precision("bfloat16", False, True)
        return Precision(None, False, device_type == "cuda")
    if capability >= (8, 0):
        return Precision("bfloat16", False, True)
    if capability >= (7, 0):
        return Precision("float16", True, True)
    return Precision(None, False, True)


def autocast(device: torch.device, amp_dtype: str | None) -> contextlib.AbstractContextManager:
    if amp_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=getattr(torch, amp_dtype))


def grad_scaler(device: torch.device, enabled: bool) -> torch.amp.GradScaler:
    """torch's GradScaler for the device; disabled it passes losses and steps through unchanged, so
    the loop has one path (`scale(loss).backward(); step(optimizer); update()`) for every device."""
    return torch.amp.GradScaler(device.type, enabled=enabled)


# ---------------------------------------------------------------------------- optimizer and schedule


def make_optimizer(model: nn.Module, optimizer: str, learning_rate: float,
                   weight_decay: float) -> torch.optim.Optimizer:
    """Weight decay on weight matrices and kernels only: biases and normalisation scales are left
    alone (decaying them only shrinks what the normalisation re-learns; timm's default too)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    groups: list[dict[str, Any]] = [{"params": decay, "weight_decay": weight_decay},
                                    {"params": no_decay, "weight_decay": 0.0}]
    if optimizer == "sgd":
        return torch.optim.SGD(groups, lr=learning_rate, momentum=0.9)
    if optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=learning_rate)
    return torch.optim.Adam(groups, lr=learning_rate)


def build_scheduler(optimizer: torch.optim.Optimizer, schedule: str, *, total_steps: int, warmup_fraction: float,
                    peak_lr: float) -> lr_scheduler.LRScheduler | None:
    """torch's schedulers, stepped once per optimizer step (`total_steps` of them in the run).

    - onecycle: OneCycleLR (Smith): from peak/25 up to the peak over the warm-up share, then a
      cosine down to peak/25e4, with momentum (SGD) or beta1 (Adam family) cycled inversely.
    - cosine: a linear warm-up over the warm-up share, then cosine annealing to 0.
    - constant: the learning rate as given (None: nothing to step).
    """
    total_steps = max(1, total_steps)
    if schedule == "onecycle":
        # Whole steps of warm-up: OneCycleLR divides by zero when the warm-up is exactly one step,
        # and a run of a handful of steps gets none.
        warm = min(total_steps - 1, round(warmup_fraction * total_steps))
        return lr_scheduler.OneCycleLR(optimizer, max_lr=peak_lr, total_steps=total_steps,
                                       pct_start=warm / total_steps if warm >= 2 else 0.0)
    if schedule == "cosine":
        warm = min(total_steps - 1, round(warmup_fraction * total_steps))
        cosine = lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, total_steps - warm))
        if warm <= 0:
            return cosine
        ramp = lr_scheduler.LinearLR(optimizer, start_factor=1.0 / (warm + 1), end_factor=1.0, total_iters=warm)
        return lr_scheduler.SequentialLR(optimizer, [ramp, cosine], milestones=[warm])
    return None


def current_lr(optimizer: torch.optim.Optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])


# ---------------------------------------------------------------------------- best epoch, early stopping


@dataclass(frozen=True)
class Score:
    accuracy: float
    loss: float


class EarlyStopping:
    """Tracks the best validation epoch by `monitor` and stops after `patience` epochs without an
    improvement (0: never stops early).

    Two questions, answered apart. Which epoch's weights to keep (`best`): val_accuracy, higher is
    better and a tie goes to the lower val_loss (on a small validation split accuracy moves in
    coarse steps, and a plateau at 100 % would otherwise pin the best epoch to the first that
    reached it); val_loss, lower is better. Whether the run still improves (patience): only a
    strictly better `monitor` counts. The tie-break chooses weights but never resets patience: once
    validation accuracy saturates, val_loss keeps falling a little almost every epoch (the net grows
    more confident), and counting that kept a long job on `fake` running for ever after it reached
    100 % (docs/training.md)."""

    def __init__(self, monitor: str, patience: int) -> None:
        self.monitor = monitor
        self.patience = patience
        self.best_epoch: int | None = None
        self.best: Score | None = None
        self.epochs_without_improvement = 0

    def improves(self, score: Score) -> bool:
        """Does `score` beat every epoch so far on the monitor itself (what patience counts)?"""
        if self.best is None or math.isnan(self.best.loss):
            return True
        if self.monitor == "val_loss":
            return score.loss < self.best.loss
        return score.accuracy > self.best.accuracy  # best.accuracy is the highest seen: ties only lower the loss

    def better(self, score: Score) -> bool:
        """Are `score`'s weights the ones to keep: an improvement, or the same accuracy at a lower loss?"""
        if self.improves(score):
            return True
        assert self.best is not None
        return self.monitor == "val_accuracy" and score.accuracy == self.best.accuracy and score.loss < self.best.loss

    def update(self, epoch: int, score: Score) -> bool:
        """Record an epoch's validation; True when its weights are the new best."""
        improved, better = self.improves(score), self.better(score)
        self.epochs_without_improvement = 0 if improved else self.epochs_without_improvement + 1
        if better:
            self.best_epoch, self.best = epoch, score
        return better

    @property
    def should_stop(self) -> bool:
        return self.patience > 0 and self.epochs_without_improvement >= self.patience

    def reason(self) -> str:
        assert self.best is not None
        value = self.best.accuracy if self.monitor == "val_accuracy" else self.best.loss
        return (f"early stopping: {self.monitor} did not improve for {self.epochs_without_improvement} "
                f"epoch{'' if self.epochs_without_improvement == 1 else 's'} "
                f"(patience {self.patience}); best {value:.4f} at epoch {self.best_epoch}")

    def state_dict(self) -> dict[str, Any]:
        return {"best_epoch": self.best_epoch, "epochs_without_improvement": self.epochs_without_improvement,
                "best": None if self.best is None else [self.best.accuracy, self.best.loss]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_epoch = state["best_epoch"]
        self.epochs_without_improvement = int(state["epochs_without_improvement"])
        self.best = None if state["best"] is None else Score(float(state["best"][0]), float(state["best"][1]))
