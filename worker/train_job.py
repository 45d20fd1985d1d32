"""A training job on this worker's device: data in, checkpoint out.

Reads the params stored at submit (core/params.py), loads the starting weights when the job has
some (`init_from` a job, or `pretrained`: worker/init_weights.py), loads the dataset at the
architecture's input size (and the starting weights' resize), lets `plan_training` add this
device's choices (recorded into the job's params), and runs the loop of worker/trainer.py. Its
outcome is the final checkpoint and its sha256; the kept epoch, why training ended and the
validation of the kept weights go into the job's record.
"""

from __future__ import annotations

import torch

from core.params import TrainingParams
from core.schemas import CheckpointInfo, Job
from core.storage import sha256_file
from models.registry import get_model_spec
from worker import init_weights
from worker.data import load_dataset
from worker.init_weights import InitialWeights
from worker.job_context import JobContext, JobFailed, JobOutcome
from worker.trainer import Trainer, plan_training


def run_train_job(job: Job, ctx: JobContext) -> JobOutcome:
    params = TrainingParams.model_validate(job.params)  # resolved at submit (core/params.py)
    spec = get_model_spec(job.model)
    size = params.image_size
    height, width = (size, size) if not spec.input.fixed_size else (spec.input.height, spec.input.width)
    channels = spec.input.channels
    device = torch.device(ctx.device.torch_device)
    initial = _initial_weights(job, params, ctx, device)
    resize = round(height * initial.resize_ratio) if initial is not None and initial.resize_ratio else None
    record = ctx.catalog.get(job.dataset)
    data = load_dataset(record, ctx.settings, channels, height, width, seed=params.seed, resize_size=resize)
    ctx.set_classes(data.classes)
    plan = plan_training(job.id, job.model, params, data, device, channels, height, width)
    ctx.set_params({**job.params, **plan.as_params(), "resize_size": resize})
    # model.pt is this delivery's until it finishes the job; resume states are per epoch and
    # recorded with the epoch's metrics (worker/job_context.py).
    trainer = Trainer(plan, data, final_path=ctx.output_path("model.pt"), resume_from=ctx.resume_state(),
                      resume_to=lambda epoch: ctx.scratch_path(f"resume-{epoch}.pt"),
                      reporter=ctx.reporter, should_stop=ctx.should_stop, dataset=job.dataset, initial=initial,
                      resize_size=resize)
    result = trainer.run()
    ctx.set_training_outcome(result.best_epoch, result.stop_reason)
    if result.validation is not None:
        ctx.set_evaluation(result.validation.model_dump())
    return JobOutcome(checkpoint=CheckpointInfo(url=f"/jobs/{job.id}/checkpoint", sha256=sha256_file(result.final_path),
                                                bytes=result.final_path.stat().st_size))


def _initial_weights(job: Job, params: TrainingParams, ctx: JobContext, device: torch.device) -> InitialWeights | None:
    if params.init_from:
        parent = ctx.store.get(params.init_from)
        if parent.model != job.model:  # checked at submit; the record could only change by hand
            raise JobFailed(f"init_from: job {parent.id} trained {parent.model}, not {job.model}")
        return init_weights.from_job(parent, ctx.paths, device)
    if params.pretrained:
        return init_weights.from_pretrained(job.model, ctx.settings, device)
    return None
