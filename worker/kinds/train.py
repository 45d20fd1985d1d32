"""A training job on this worker's device: data in, checkpoint out.

Reads the params stored at submit (core/kinds/train/), loads the starting weights when the job has
some (`init_from` a job, or `pretrained`: worker/training/init_weights.py), loads the dataset at the input
size and resize resolved at submit, lets `plan_training` make this device's choices (recorded
beside the params as the job's `device_choices`, never into them), and runs the loop of
worker/training/trainer.py. Its
outcome is the final checkpoint and its sha256; the kept epoch, why training ended and the
validation of the kept weights go into the job's record. A data-parallel job's ranks prepare the
same inputs (`training_inputs`) and train in worker/gang/training.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from core.config import Settings
from core.datasets import DatasetCatalog
from core.jobs import JobStore
from core.kinds.train.params import TrainingParams
from core.schemas import CheckpointInfo, Job
from core.storage import CheckpointPaths, sha256_file
from worker.data.datasets import ImageTensors, load_dataset
from worker.runtime.job_context import JobContext, JobFailed, JobOutcome
from worker.training import init_weights
from worker.training.init_weights import InitialWeights
from worker.training.pruning import trial_judge
from worker.training.trainer import Trainer, TrainingResult, plan_training


@dataclass(frozen=True)
class TrainingInputs:
    """What a run starts from: the stored params, the input spec, the starting weights and the data."""

    params: TrainingParams
    channels: int
    height: int
    width: int
    initial: InitialWeights | None
    resize: int | None
    data: ImageTensors
    device: torch.device


def training_inputs(job: Job, settings: Settings, catalog: DatasetCatalog, store: JobStore, paths: CheckpointPaths,
                    torch_device: str, should_stop: Callable[[], str | None] | None = None) -> TrainingInputs:
    params = TrainingParams.of(job)  # resolved at submit (core/kinds/train/resolution.py)
    channels, height, width = params.input_for(job.model)
    device = torch.device(torch_device)
    initial = _initial_weights(job, params, settings, store, paths, device)
    if "resize_size" in params.model_fields_set:  # resolved at submit
        resize = params.resize_size
    else:  # a record from before that: the starting weights' own ratio, as it was decided then
        resize = round(height * initial.resize_ratio) if initial is not None and initial.resize_ratio else None
    data = load_dataset(catalog.get(job.dataset), settings, channels, height, width, seed=params.seed,
                        resize_size=resize, should_stop=should_stop, device=torch_device)
    return TrainingInputs(params, channels, height, width, initial, resize, data, device)


def run_train_job(job: Job, ctx: JobContext) -> JobOutcome:
    inputs = training_inputs(job, ctx.settings, ctx.catalog, ctx.store, ctx.paths, ctx.device.torch_device,
                             ctx.should_stop)
    ctx.set_classes(inputs.data.classes)
    plan = plan_training(job.id, job.model, inputs.params, inputs.data, inputs.device, inputs.channels,
                         inputs.height, inputs.width, earlier=job.device_choices)
    ctx.record({"device_choices": plan.device.model_dump()})
    # model.pt is this delivery's until it finishes the job; resume states are per epoch and
    # recorded with the epoch's metrics (worker/runtime/job_context.py).
    trainer = Trainer(plan, inputs.data, final_path=ctx.output_path("model.pt"), resume_from=ctx.resume_state(),
                      resume_to=lambda epoch: ctx.scratch_path(f"resume-{epoch}.pt"),
                      reporter=ctx.reporter, should_stop=ctx.should_stop, dataset=job.dataset, initial=inputs.initial,
                      resize_size=inputs.resize,
                      judge=trial_judge(job, ctx.settings.resolved_redis_url(), ctx.store.redis))
    return record_outcome(job, ctx, trainer.run())


def record_outcome(job: Job, ctx: JobContext, result: TrainingResult) -> JobOutcome:
    """The kept epoch, why training ended and the kept weights' validation, into the job; the checkpoint."""
    ctx.set_training_outcome(result.best_epoch, result.stop_reason)
    if result.validation is not None:
        ctx.set_evaluation(result.validation.model_dump())
    final: Path = result.final_path
    return JobOutcome(checkpoint=CheckpointInfo(url=f"/jobs/{job.id}/checkpoint", sha256=sha256_file(final),
                                                bytes=final.stat().st_size))


def _initial_weights(job: Job, params: TrainingParams, settings: Settings, store: JobStore, paths: CheckpointPaths,
                     device: torch.device) -> InitialWeights | None:
    if params.init_from:
        parent = store.get(params.init_from)
        if parent.model != job.model:  # checked at submit; the record could only change by hand
            raise JobFailed(f"init_from: job {parent.id} trained {parent.model}, not {job.model}")
        return init_weights.from_job(parent, paths, device)
    if params.pretrained:
        return init_weights.from_pretrained(job.model, settings, device)
    return None
