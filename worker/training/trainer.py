"""The training loop on one device: batches from resident or staged data, per-image augmentation,
the recipe (schedule, weight decay, label smoothing, mixed precision where native), per-epoch
validation with early stopping, the best epoch's weights kept, resumable checkpoints, and a
smaller micro-batch when the GPU runs out of memory (the step itself: worker/training/train_step.py). As
one rank of a data-parallel job, the same loop under a gang's `Placement` (worker/gang/collectives.py).

The loop knows nothing about Redis or Celery: it reports through a `JobReporter` and asks
`should_stop()` every step, which is how cancellation, a lost lease and worker shutdown reach it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from core.kinds.train.params import TrainingParams, schedule_for, validation_batch
from core.schemas import DeviceChoices, EpochMetrics, EvaluationResult, Progress
from models.registry import build_model
from worker.checkpoints.format import ModelMeta, Preprocessing, save_model
from worker.data.datasets import ImageTensors, split
from worker.data.normalization import channel_stats, stats_tensors
from worker.device.info import cpu_flags
from worker.runtime.job_context import JobReporter, StopJob
from worker.training import init_weights
from worker.training.backoff import BatchBackoff
from worker.training.evaluation import Measured, measure
from worker.training.init_weights import InitialWeights
from worker.training.recipe import (
    EarlyStopping,
    Score,
    autocast,
    build_scheduler,
    choose_precision,
    current_lr,
    grad_scaler,
    make_optimizer,
)
from worker.training.resume import BestEpoch, ResumableRun
from worker.training.shape_tuning import batch_bounds, epoch_shapes, tune_shapes
from worker.training.staging import STAGING_BUFFERS, Batches, ResidentBatches, StagedBatches
from worker.training.train_step import OneDevice, Placement, StepRunner

log = logging.getLogger(__name__)


PROGRESS_EVERY_S = 0.5
# The split stays on the GPU when it takes less than this share of the free memory; the rest is
# for the model, its activations and the worker's /predict models.
RESIDENT_SHARE = 0.4


# After an epoch: (the epoch, its logged values by name) -> why training stops here, or None.
EpochJudge = Callable[[int, dict[str, float | None]], str | None]


class NonFiniteLoss(Exception):
    pass


@dataclass(frozen=True)
class TrainingPlan:
    """One run: the job's params as stored at submit, and this device's choices for them (recorded
    beside the params as the job's `device_choices`), on input of channels × height × width."""

    job_id: str
    architecture: str
    params: TrainingParams
    device: DeviceChoices
    channels: int
    height: int
    width: int

    def with_choices(self, **changes: Any) -> TrainingPlan:
        """The plan with some of the device's choices made otherwise (a gang's follower takes rank 0's
        precision; the tests force a GPU's choices on the CPU)."""
        return replace(self, device=self.device.model_copy(update=changes))


@dataclass(frozen=True)
class TrainingResult:
    meta: ModelMeta
    final_path: Path
    metrics: list[EpochMetrics]
    best_epoch: int | None  # the epoch whose weights final_path holds
    stop_reason: str
    validation: EvaluationResult | None  # the validation split on those weights


def plan_training(job_id: str, architecture: str, params: TrainingParams, data: ImageTensors,
                  device: torch.device, channels: int, height: int, width: int,
                  earlier: DeviceChoices | None = None) -> TrainingPlan:
    """This device's choices for the job's stored params: the fast path, every choice recorded.

    `earlier` is what an earlier delivery (or, for a gang's follower, rank 0) recorded: the batch and
    the schedule it ran are kept, so a job resumed on another device type (an "auto" job requeued
    from a GPU to a CPU, an elastic gang placed again) goes on with the run its resume state holds;
    the rest (precision, placement) is this device's."""
    cuda = device.type == "cuda"
    batch_size = earlier.batch_size if earlier is not None and params.batch_size is None else params.batch_for(device.type)
    precision = choose_precision(device.type, torch.cuda.get_device_capability(device) if cuda else None, cpu_flags(),
                                 mixed=params.precision == "auto")
    n_train = len(data.labels) - len(split(len(data.labels), params.val_fraction, params.seed)[1])
    steps = len(batch_bounds(n_train, batch_size)) * params.epochs
    on_device = True  # a CPU worker's "device" memory is the host's
    if cuda:
        free, _ = torch.cuda.mem_get_info(device)
        on_device = data.images.numel() < RESIDENT_SHARE * free
    choices = DeviceChoices(
        device=str(device), batch_size=batch_size,
        schedule=earlier.schedule if earlier is not None else schedule_for(params, steps),
        amp_dtype=precision.amp_dtype, grad_scaler=precision.grad_scaler, channels_last=precision.channels_last,
        cudnn_benchmark=cuda, data_on_device=on_device, staging_buffers=0 if on_device else STAGING_BUFFERS)
    return TrainingPlan(job_id, architecture, params, choices, channels, height, width)


class Trainer:
    def __init__(self, plan: TrainingPlan, data: ImageTensors, *, final_path: Path, resume_from: Path | None,
                 resume_to: Callable[[int], Path], reporter: JobReporter, should_stop: Callable[[], str | None],
                 dataset: str = "", initial: InitialWeights | None = None, resize_size: int | None = None,
                 placement: Placement | None = None, judge: EpochJudge | None = None) -> None:
        self.plan = plan
        self.data = data
        self.final_path = final_path
        # Resume state (worker/training/resume.py): read from where the last recorded epoch's was recorded (if
        # any); each epoch's written to a file of its own, recorded with that epoch's metrics.
        self.resume_from = resume_from
        self.resume_to = resume_to
        self.reporter = reporter
        self.should_stop = should_stop
        self.dataset = dataset
        self.initial = initial
        self.resize_size = resize_size
        self.device = torch.device(plan.device.device)
        self.placement = placement or OneDevice()
        self.judge = judge  # a sweep's trial: its pruner's verdict after each epoch (worker/training/pruning.py)

    # ------------------------------------------------------------------ the run
    def run(self) -> TrainingResult:
        plan, params, choices, device = self.plan, self.plan.params, self.plan.device, self.device
        torch.manual_seed(params.seed)
        if choices.cudnn_benchmark:
            torch.backends.cudnn.benchmark = True

        classes = self.data.classes
        train_idx, val_idx = split(len(self.data.labels), params.val_fraction, params.seed)
        train = self._batches(train_idx, choices.batch_size)
        val = self._batches(self.placement.shard(val_idx), validation_batch(choices.batch_size))
        pre = self._preprocessing(train.images)  # the split where it trains: on a GPU, milliseconds
        mean_t, std_t = stats_tensors(pre, device)

        model = build_model(plan.architecture, len(classes), plan.channels)
        lineage = None
        if self.initial is not None:
            head = init_weights.apply(model, plan.architecture, self.initial, classes)
            lineage = {**self.initial.lineage, "head": head}
        model = model.to(device)
        if choices.channels_last:
            model = model.to(memory_format=torch.channels_last)
        meta = ModelMeta(plan.architecture, len(classes), classes, pre, plan.job_id, lineage=lineage)

        n = len(train)
        bounds = batch_bounds(n, choices.batch_size)
        steps = len(bounds)
        optimizer = make_optimizer(model, params.optimizer, params.learning_rate, params.decay)
        scheduler = build_scheduler(optimizer, choices.schedule, total_steps=params.epochs * steps,
                                    warmup_fraction=params.warmup_fraction, peak_lr=params.learning_rate)
        scaler = grad_scaler(device, choices.grad_scaler)
        loss_fn = nn.CrossEntropyLoss(label_smoothing=params.label_smoothing).to(device)
        backoff = self._backoff(choices.batch_size, "training")
        eval_backoff = self._backoff(validation_batch(choices.batch_size), "validation")
        stopper = EarlyStopping(params.monitor, params.patience)
        history: list[EpochMetrics] = []
        run = ResumableRun(model, optimizer, scheduler, scaler, stopper, backoff, device)
        start_epoch, best, stop_reason = run.restore(self.resume_from, history) if self.resume_from else (1, None, None)
        if start_epoch > 1:
            log.info("job %s resumes after epoch %d", plan.job_id, start_epoch - 1)
            self.reporter.resumed(start_epoch - 1)
        steps_runner = StepRunner(device, self.placement, augment=params.augment, channels_last=choices.channels_last,
                                  autocast=self._autocast, one_image_split=n == 1)
        train_model = self.placement.wrap(model)  # a gang's rank: DistributedDataParallel

        def validate(net: nn.Module, batches: Batches, back_off: BatchBackoff | None = eval_backoff) -> Measured | None:
            return measure(net, batches, len(classes), mean=mean_t, std=std_t, device=device, backoff=back_off,
                           channels_last=choices.channels_last, autocast=self._autocast, batch_size=eval_backoff.size,
                           should_stop=self.should_stop)

        # Each shape of an epoch tuned before its clock starts (worker/training/shape_tuning.py), on one device: a gang's
        # ranks would each need the same twin steps in lockstep (their BatchNorm's collectives).
        if choices.cudnn_benchmark and isinstance(self.placement, OneDevice):
            shapes = epoch_shapes((plan.channels, plan.height, plan.width), bounds, len(val), eval_backoff.size)
            tune_shapes(model, optimizer, scaler, shapes, validate=lambda net, batches: validate(net, batches, None),
                        step=lambda net, opt, scl, x, y, gen: steps_runner.accumulate(net, opt, scl, loss_fn, x, y, gen,
                                                                                      mean_t, std_t, backoff.size))

        last_measured: Measured | None = None
        epoch = start_epoch - 1
        for epoch in range(start_epoch, params.epochs + 1):
            if stop_reason is not None:  # an earlier delivery stopped early and died before saving
                break
            # The order depends only on (seed, epoch), so a resumed job sees the same batches.
            index_gen = torch.Generator(device=train.index_device).manual_seed(params.seed * 100_003 + epoch)
            order = torch.randperm(n, device=train.index_device, generator=index_gen)
            aug_gen = torch.Generator(device=device).manual_seed(params.seed * 100_003 + epoch + 1)
            model.train()
            loss_sum = torch.zeros((), device=device)
            correct = torch.zeros((), device=device, dtype=torch.int64)
            step_lr = current_lr(optimizer)
            started = last_report = time.perf_counter()
            for step, (begin, end) in enumerate(bounds, start=1):
                if (reason := self.should_stop()) is not None:
                    raise StopJob(reason)
                x, y = train.take(self.placement.shard(order[begin:end]))
                step_loss, step_correct = steps_runner.step(train_model, optimizer, scaler, loss_fn, x, y, aug_gen,
                                                            mean_t, std_t, backoff)
                step_lr = current_lr(optimizer)  # what this step used (the scheduler moves on below)
                if scheduler is not None:
                    scheduler.step()
                loss_sum += step_loss
                correct += step_correct
                if time.perf_counter() - last_report >= PROGRESS_EVERY_S:
                    last_report = time.perf_counter()
                    self.reporter.progress(Progress(epoch=epoch, epochs=params.epochs, step=step, steps=steps))
            loss_sum, correct = self.placement.reduce_sums(loss_sum, correct)
            train_loss = float(loss_sum) / n
            if not math.isfinite(train_loss):
                raise NonFiniteLoss(f"the training loss became {train_loss} in epoch {epoch}; "
                                    f"try a lower learning_rate (was {params.learning_rate})")
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - started
            measured = self.placement.reduce_measured(validate(model, val), len(classes))
            last_measured = measured
            if measured is not None and stopper.update(epoch, Score(measured.accuracy, measured.loss)):
                best = BestEpoch.of(epoch, model, measured)
            if stopper.should_stop and epoch < params.epochs:
                stop_reason = stopper.reason()
            stop_kind = "early_stop"
            if stop_reason is None and self.judge is not None and epoch < params.epochs:
                stop_reason = self.judge(epoch, {
                    "train_loss": train_loss, "train_accuracy": int(correct) / n,
                    "val_loss": measured.loss if measured else None,
                    "val_accuracy": measured.accuracy if measured else None})
                stop_kind = "pruned"
            final_epoch = epoch == params.epochs or stop_reason is not None
            metrics = EpochMetrics(
                epoch=epoch, train_loss=round(train_loss, 6), train_accuracy=round(int(correct) / n, 6),
                val_loss=measured.loss if measured else None, val_accuracy=measured.accuracy if measured else None,
                images_per_second=round(n / seconds, 1), seconds=round(seconds, 3),
                per_class_accuracy=measured.per_class_accuracy(classes) if measured else None,
                confusion_matrix=measured.confusion_list() if measured and final_epoch else None,
                learning_rate=step_lr,
            )
            history.append(metrics)
            resume = self.resume_to(epoch)
            if self.placement.leader:  # rank 0 writes it: every rank of a gang holds the same state
                run.save(resume, epoch, history, best, stop_reason)
            self.reporter.epoch(metrics, resume)
            self.reporter.progress(Progress(epoch=epoch, epochs=params.epochs, step=steps, steps=steps))
            if stop_reason is not None:
                self.reporter.notice(stop_kind, {"epoch": epoch, "best_epoch": stopper.best_epoch}, stop_reason)
                break
        epochs_run = history[-1].epoch if history else epoch
        stop_reason = stop_reason or f"completed {epochs_run} epoch{'' if epochs_run == 1 else 's'}"

        kept_epoch, kept = epochs_run, last_measured
        if params.keep == "best" and best is not None:
            model.load_state_dict(best.state_dict)
            kept_epoch, kept = best.epoch, best.measured
        elif kept is None and best is not None and best.epoch == epochs_run:
            kept = best.measured  # resumed after the last epoch's checkpoint: its validation is in resume.pt
        meta = replace(meta, training={"best_epoch": kept_epoch, "keep": params.keep, "stop_reason": stop_reason,
                                       "epochs_run": epochs_run})
        if self.placement.leader:
            save_model(self.final_path, model, meta)
        validation = kept.result(classes, self.dataset, "validation", kept_epoch) if kept is not None else None
        return TrainingResult(meta, self.final_path, history, kept_epoch, stop_reason, validation)

    # ------------------------------------------------------------------ pieces
    def _preprocessing(self, train_images: torch.Tensor) -> Preprocessing:
        """The normalisation the weights expect: the starting weights' own when there are some (ImageNet's
        for pretrained, the parent job's for init_from), else the training split's statistics."""
        plan = self.plan
        if self.initial is not None:
            return Preprocessing(plan.channels, plan.height, plan.width, self.initial.mean, self.initial.std,
                                 self.resize_size)
        mean, std = channel_stats(train_images)
        return Preprocessing(plan.channels, plan.height, plan.width, tuple(mean), tuple(std), self.resize_size)

    def _batches(self, index: torch.Tensor, capacity: int) -> Batches:
        images, labels = self.data.images[index], self.data.labels[index]
        if self.plan.device.data_on_device:
            return ResidentBatches(images, labels, self.device)
        return StagedBatches(images, labels, self.device, capacity, buffers=self.plan.device.staging_buffers)

    def _backoff(self, size: int, what: str) -> BatchBackoff:
        def notify(message: str, data: dict[str, Any]) -> None:
            log.warning("job %s: %s", self.plan.job_id, message)
            self.reporter.notice("batch_backoff", data, message)

        def release() -> None:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

        return self.placement.backoff(size, what, notify, release)

    def _autocast(self) -> Any:
        return autocast(self.device, self.plan.device.amp_dtype)
