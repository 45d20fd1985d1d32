"""A model measured on labelled images: loss, accuracy, per-class accuracy and the confusion matrix.

One implementation for the validation pass of every training epoch (worker/training/trainer.py) and for
evaluation jobs (worker/kinds/evaluate.py). Everything accumulates on the device (the confusion
matrix is one `bincount` of true × predicted per batch); the host reads the totals once at the
end.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from core.defaults import EVAL_BATCH
from core.schemas import MAX_CONFUSION_CLASSES, EvaluationResult
from worker.data.normalization import normalize
from worker.runtime.job_context import StopJob
from worker.training.backoff import BatchBackoff
from worker.training.staging import Batches


@dataclass(frozen=True)
class Measured:
    num_images: int
    loss: float  # mean cross-entropy (no label smoothing: comparable across recipes)
    accuracy: float
    confusion: torch.Tensor  # C×C int64 on the CPU: rows true class, columns predicted

    def per_class_accuracy(self, classes: list[str]) -> dict[str, float]:
        totals = self.confusion.sum(dim=1)
        hits = self.confusion.diagonal()
        return {name: round(int(h) / int(t), 4) for name, h, t in zip(classes, hits, totals, strict=True) if int(t)}

    def confusion_list(self) -> list[list[int]] | None:
        return self.confusion.tolist() if len(self.confusion) <= MAX_CONFUSION_CLASSES else None

    def result(self, classes: list[str], dataset: str, split: Literal["validation", "test", "all"],
               epoch: int | None = None) -> EvaluationResult:
        return EvaluationResult(dataset=dataset, split=split, epoch=epoch, num_images=self.num_images,
                                accuracy=self.accuracy, loss=self.loss, classes=classes,
                                per_class_accuracy=self.per_class_accuracy(classes),
                                confusion_matrix=self.confusion_list())


@torch.inference_mode()
def measure(model: nn.Module, batches: Batches, num_classes: int, *, mean: torch.Tensor, std: torch.Tensor,
            device: torch.device, channels_last: bool = False,
            autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
            backoff: BatchBackoff | None = None, batch_size: int = EVAL_BATCH,
            label_map: torch.Tensor | None = None, should_stop: Callable[[], str | None] | None = None,
            on_batch: Callable[[int, int], None] | None = None) -> Measured | None:
    """`model` (put in eval mode) over every image of `batches`; None when there are none.
    `label_map` maps the data's label indices to the model's (evaluating on a dataset whose classes
    are the model's in another order, or a subset). `backoff` shrinks the forward passes on a CUDA
    out-of-memory error."""
    n = len(batches)
    if n == 0:
        return None
    model.eval()
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    confusion = torch.zeros(num_classes * num_classes, device=device, dtype=torch.int64)
    if label_map is not None:
        label_map = label_map.to(device)
    steps = -(-n // batch_size)
    for step, begin in enumerate(range(0, n, batch_size), start=1):
        if should_stop is not None and (reason := should_stop()) is not None:
            raise StopJob(reason)
        images, labels = batches.slice(begin, min(begin + batch_size, n))
        if label_map is not None:
            labels = label_map[labels]
        done = 0
        while done < len(labels):
            size = backoff.size if backoff is not None else len(labels)
            error = None
            try:
                x = normalize(images[done:done + size], mean, std)
                if channels_last:
                    x = x.contiguous(memory_format=torch.channels_last)
                y = labels[done:done + size]
                with autocast():
                    logits = model(x).float()
                loss_sum += F.cross_entropy(logits, y, reduction="sum").double()
                confusion += torch.bincount(y * num_classes + logits.argmax(1), minlength=num_classes * num_classes)
                done += len(y)
            except torch.OutOfMemoryError as exc:
                if backoff is None:
                    raise
                error = str(exc)
            if error is not None and backoff is not None:
                backoff.out_of_memory(error)  # outside the except: the failed pass's tensors are gone
        if on_batch is not None:
            on_batch(step, steps)
    matrix = confusion.view(num_classes, num_classes).cpu()
    total = int(matrix.sum())
    return Measured(num_images=total, loss=round(float(loss_sum) / total, 6),
                    accuracy=round(int(matrix.diagonal().sum()) / total, 6), confusion=matrix)
