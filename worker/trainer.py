"""The training loop on one device: tensors resident, batches sliced in place, per-epoch
metrics and resumable checkpoints.

The loop knows nothing about Redis or Celery: it reports through a `TrainingReporter` and asks
`should_stop()` every step, which is how cancellation, a lost lease and worker shutdown reach it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from app.core.schemas import EpochMetrics, Progress
from app.core.training import DEFAULT_LR
from models.registry import build_model
from worker.checkpoint import ModelMeta, Preprocessing, load_payload, save_model, save_resume_state
from worker.data import ImageTensors, split
from worker.preprocess import channel_stats, normalize, stats_tensors

log = logging.getLogger(__name__)


PROGRESS_EVERY_S = 0.5


class StopTraining(Exception):
    """Raised inside the loop when the job must stop now (reason: cancelled, shutdown, lease_lost)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class NonFiniteLoss(Exception):
    pass


class TrainingReporter(Protocol):
    def progress(self, progress: Progress) -> None: ...
    def epoch(self, metrics: EpochMetrics) -> None: ...
    def resumed(self, epoch: int) -> None: ...


@dataclass(frozen=True)
class TrainingPlan:
    """Resolved, device-aware settings of one run (what goes into the job's params)."""

    job_id: str
    architecture: str
    epochs: int
    batch_size: int
    learning_rate: float
    optimizer: str
    seed: int
    val_fraction: float
    channels: int
    height: int
    width: int
    augment: bool
    device: str
    amp_dtype: str | None
    channels_last: bool
    cudnn_benchmark: bool
    data_on_device: bool
    pinned_memory: bool

    def as_params(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("job_id", "architecture")}


@dataclass(frozen=True)
class TrainingResult:
    meta: ModelMeta
    final_path: Path
    metrics: list[EpochMetrics]


def plan_training(job_id: str, architecture: str, params: dict[str, Any], data: ImageTensors,
                  device: torch.device, channels: int, height: int, width: int) -> TrainingPlan:
    """Pick the fast path for this device and record every choice."""
    cuda = device.type == "cuda"
    batch_size = params.get("batch_size") or (256 if cuda else 128)
    optimizer = params.get("optimizer", "adam")
    bf16 = cuda and torch.cuda.is_bf16_supported()
    data_bytes = data.images.numel()
    on_device = False
    if cuda:
        free, _ = torch.cuda.mem_get_info(device)
        on_device = data_bytes < 0.4 * free
    return TrainingPlan(
        job_id=job_id, architecture=architecture, epochs=int(params["epochs"]), batch_size=int(batch_size),
        learning_rate=float(params.get("learning_rate") or DEFAULT_LR[optimizer]), optimizer=optimizer,
        seed=int(params.get("seed", 0)), val_fraction=float(params.get("val_fraction", 0.1)),
        channels=channels, height=height, width=width, augment=bool(params.get("augment", False)),
        device=str(device), amp_dtype="bfloat16" if bf16 else None, channels_last=cuda,
        cudnn_benchmark=cuda, data_on_device=on_device or not cuda, pinned_memory=cuda and not on_device,
    )


def _make_optimizer(plan: TrainingPlan, model: nn.Module) -> torch.optim.Optimizer:
    if plan.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=plan.learning_rate, momentum=0.9)
    if plan.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=plan.learning_rate, weight_decay=0.01)
    return torch.optim.Adam(model.parameters(), lr=plan.learning_rate)


def _augment(batch: torch.Tensor, generator: torch.Generator, crop_generator: torch.Generator) -> torch.Tensor:
    """Random horizontal flip and 4-pixel-padded random crop, on whatever device the batch is.
    The crop offset comes from a CPU generator: drawing it on the GPU would sync every step."""
    n, _, h, w = batch.shape
    flip = torch.rand(n, device=batch.device, generator=generator) < 0.5
    batch = torch.where(flip[:, None, None, None], batch.flip(3), batch)
    padded = F.pad(batch, (4, 4, 4, 4), mode="reflect")
    dx, dy = (int(v) for v in torch.randint(0, 9, (2,), generator=crop_generator))
    return padded[:, :, dy:dy + h, dx:dx + w]


class Trainer:
    def __init__(self, plan: TrainingPlan, data: ImageTensors, *, final_path: Path, resume_path: Path,
                 reporter: TrainingReporter, should_stop: Callable[[], str | None]) -> None:
        self.plan = plan
        self.data = data
        self.final_path = final_path
        self.resume_path = resume_path
        self.reporter = reporter
        self.should_stop = should_stop
        self.device = torch.device(plan.device)

    def run(self) -> TrainingResult:
        plan, device = self.plan, self.device
        torch.manual_seed(plan.seed)
        if plan.cudnn_benchmark:
            torch.backends.cudnn.benchmark = True

        train_idx, val_idx = split(len(self.data.labels), plan.val_fraction, plan.seed)
        mean, std = channel_stats(self.data.images[train_idx])
        pre = Preprocessing(plan.channels, plan.height, plan.width, tuple(mean), tuple(std))
        meta = ModelMeta(plan.architecture, len(self.data.classes), self.data.classes, pre, plan.job_id)

        images, labels = self._place(self.data.images[train_idx]), self._place(self.data.labels[train_idx])
        val_images, val_labels = self._place(self.data.images[val_idx]), self._place(self.data.labels[val_idx])
        mean_t, std_t = stats_tensors(pre, device)

        model = build_model(plan.architecture, meta.num_classes, plan.channels).to(device)
        if plan.channels_last:
            model = model.to(memory_format=torch.channels_last)
        optimizer = _make_optimizer(plan, model)
        loss_fn = nn.CrossEntropyLoss().to(device)
        history: list[EpochMetrics] = []
        start_epoch = self._resume(model, optimizer, history)
        if start_epoch > 1:
            self.reporter.resumed(start_epoch - 1)

        n = len(labels)
        steps = math.ceil(n / plan.batch_size)
        for epoch in range(start_epoch, plan.epochs + 1):
            # The order depends only on (seed, epoch), so a resumed job sees the same batches.
            index_gen = torch.Generator(device=images.device).manual_seed(plan.seed * 100_003 + epoch)
            order = torch.randperm(n, device=images.device, generator=index_gen)
            aug_gen = torch.Generator(device=device).manual_seed(plan.seed * 100_003 + epoch + 1)
            crop_gen = torch.Generator().manual_seed(plan.seed * 100_003 + epoch + 2)
            model.train()
            loss_sum = torch.zeros((), device=device)
            correct = torch.zeros((), device=device, dtype=torch.int64)
            started = last_report = time.perf_counter()
            for step, begin in enumerate(range(0, n, plan.batch_size), start=1):
                if (reason := self.should_stop()) is not None:
                    raise StopTraining(reason)
                idx = order[begin:begin + plan.batch_size]
                x = self._gather(images, idx, step)
                y = self._to_device(labels[idx])
                x = normalize(x, mean_t, std_t)
                if plan.augment:
                    x = _augment(x, aug_gen, crop_gen)
                if plan.channels_last:
                    x = x.contiguous(memory_format=torch.channels_last)
                with self._autocast():
                    logits = model(x)
                    loss = loss_fn(logits.float(), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                loss_sum += loss.detach() * len(y)
                correct += (logits.argmax(1) == y).sum()
                if time.perf_counter() - last_report >= PROGRESS_EVERY_S:
                    last_report = time.perf_counter()
                    self.reporter.progress(Progress(epoch=epoch, epochs=plan.epochs, step=step, steps=steps))
            train_loss = float(loss_sum) / n
            if not math.isfinite(train_loss):
                raise NonFiniteLoss(f"the training loss became {train_loss} in epoch {epoch}; "
                                    f"try a lower learning_rate (was {plan.learning_rate})")
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - started
            val_loss, val_acc, per_class = self._evaluate(model, val_images, val_labels, mean_t, std_t, meta.classes)
            metrics = EpochMetrics(
                epoch=epoch, train_loss=round(train_loss, 6), train_accuracy=round(int(correct) / n, 6),
                val_loss=val_loss, val_accuracy=val_acc, images_per_second=round(n / seconds, 1),
                seconds=round(seconds, 3), per_class_accuracy=per_class,
            )
            history.append(metrics)
            self._save_resume(model, optimizer, epoch, history)
            self.reporter.epoch(metrics)
            self.reporter.progress(Progress(epoch=epoch, epochs=plan.epochs, step=steps, steps=steps))
        save_model(self.final_path, model, meta)
        return TrainingResult(meta, self.final_path, history)

    # ------------------------------------------------------------------ placement
    def _place(self, tensor: torch.Tensor) -> torch.Tensor:
        """Whole split on the device when it fits; otherwise pinned host memory for async copies."""
        if self.plan.data_on_device:
            return tensor.to(self.device)
        return tensor.pin_memory() if self.plan.pinned_memory else tensor

    def _gather(self, images: torch.Tensor, idx: torch.Tensor, step: int) -> torch.Tensor:
        """A shuffled batch on the device. Host-resident data is gathered into one of two pinned
        staging buffers and copied asynchronously; an event guards each buffer's reuse."""
        if images.device == self.device:
            return images[idx]
        if not self.plan.pinned_memory:
            return images[idx].to(self.device)
        if not hasattr(self, "_staging"):
            shape = (self.plan.batch_size, *images.shape[1:])
            self._staging = [torch.empty(shape, dtype=images.dtype).pin_memory() for _ in range(2)]
            self._staged = [None, None]
        slot = step % 2
        if self._staged[slot] is not None:
            self._staged[slot].synchronize()
        buffer = self._staging[slot][: len(idx)]
        torch.index_select(images, 0, idx, out=buffer)
        on_device = buffer.to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._staged[slot] = event
        return on_device

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device == self.device:
            return tensor
        return tensor.to(self.device, non_blocking=True)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.plan.amp_dtype:
            return torch.autocast(device_type="cuda", dtype=getattr(torch, self.plan.amp_dtype))
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ evaluation
    @torch.inference_mode()
    def _evaluate(self, model: nn.Module, images: torch.Tensor, labels: torch.Tensor, mean: torch.Tensor,
                  std: torch.Tensor, classes: list[str]) -> tuple[float | None, float | None, dict[str, float] | None]:
        if len(labels) == 0:
            return None, None, None
        model.eval()
        num_classes = len(classes)
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        hits = torch.zeros(num_classes, device=self.device, dtype=torch.int64)
        totals = torch.zeros(num_classes, device=self.device, dtype=torch.int64)
        batch = max(self.plan.batch_size, 256)
        for begin in range(0, len(labels), batch):
            x = normalize(self._to_device(images[begin:begin + batch]), mean, std)
            y = self._to_device(labels[begin:begin + batch])
            if self.plan.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            with self._autocast():
                logits = model(x).float()
            loss_sum += F.cross_entropy(logits, y, reduction="sum").double()
            right = logits.argmax(1) == y
            totals += torch.bincount(y, minlength=num_classes)
            hits += torch.bincount(y[right], minlength=num_classes)
        total = int(totals.sum())
        per_class = {name: round(int(h) / int(t), 4) for name, h, t in zip(classes, hits, totals, strict=True) if int(t)}
        return round(float(loss_sum) / total, 6), round(int(hits.sum()) / total, 6), per_class

    # ------------------------------------------------------------------ resume
    def _save_resume(self, model: nn.Module, optimizer: torch.optim.Optimizer, epoch: int,
                     history: list[EpochMetrics]) -> None:
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        save_resume_state(self.resume_path, {
            "epoch": epoch, "model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": rng,
            "metrics": [m.model_dump() for m in history],
        })

    def _resume(self, model: nn.Module, optimizer: torch.optim.Optimizer, history: list[EpochMetrics]) -> int:
        """Continue after the last finished epoch of an earlier delivery, if there was one."""
        if not self.resume_path.exists():
            return 1
        state = load_payload(self.resume_path, map_location=self.device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["cpu"].cpu())
        if "cuda" in state["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"].cpu(), self.device)
        history.extend(EpochMetrics.model_validate(m) for m in state["metrics"])
        log.info("job %s resumes after epoch %d", self.plan.job_id, state["epoch"])
        return int(state["epoch"]) + 1
