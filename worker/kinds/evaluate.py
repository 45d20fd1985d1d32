"""An evaluation job: a trained job's checkpoint measured on a dataset, on this worker's device.

The checkpoint is loaded with `map_location` onto the device; the dataset (a built-in's test
split, or every image of an upload) is read at the checkpoint's recorded preprocessing, so the
images go through exactly what /predict does. Labels are matched to the model's classes by name
(core/kinds/evaluate/submit.py checked at submit that every class of the data is one of the model's). The
pass runs in batches with the same stop checks, progress events and out-of-memory back-off as
training; the result (accuracy, loss, per-class accuracy, confusion matrix) goes into the job's
record through the job store.
"""

from __future__ import annotations

import torch

from core.kinds.evaluate.params import EvaluateParams
from core.schemas import Job, Progress
from worker.checkpoints.format import load_model
from worker.data.datasets import evaluation_split, load_dataset
from worker.data.normalization import stats_tensors
from worker.device.info import cpu_flags
from worker.runtime.job_context import JobContext, JobFailed, JobOutcome
from worker.training.backoff import BatchBackoff
from worker.training.evaluation import measure
from worker.training.recipe import autocast, choose_precision
from worker.training.staging import ResidentBatches, StagedBatches


def run_evaluate_job(job: Job, ctx: JobContext) -> JobOutcome:
    params = EvaluateParams.of(job)  # resolved at submit (core/kinds/evaluate/params.py)
    device = torch.device(ctx.device.torch_device)
    model, meta = load_model(ctx.paths.final(params.trained_job), device)
    pre = meta.preprocessing
    ctx.set_classes(meta.classes)
    record = ctx.catalog.get(job.dataset)
    data = load_dataset(record, ctx.settings, pre.channels, pre.height, pre.width, resize_size=pre.resize_size,
                        split="test", should_stop=ctx.should_stop, device=ctx.device.torch_device)
    unknown = [name for name in data.classes if name not in meta.classes]
    if unknown:
        raise JobFailed(f"dataset {job.dataset} has classes the model does not: {', '.join(unknown[:20])}")
    label_map = torch.tensor([meta.classes.index(name) for name in data.classes], dtype=torch.int64)

    cuda = device.type == "cuda"
    precision = choose_precision(device.type, torch.cuda.get_device_capability(device) if cuda else None, cpu_flags())
    if precision.channels_last:
        model = model.to(memory_format=torch.channels_last)
    batch_size = params.batch_size
    mean, std = stats_tensors(pre, device)

    def notify(message: str, data: dict) -> None:
        ctx.reporter.notice("batch_backoff", data, message)

    def release() -> None:
        if cuda:
            torch.cuda.empty_cache()

    backoff = BatchBackoff(batch_size, "evaluation", notify=notify, release=release)

    def progress(step: int, steps: int) -> None:
        ctx.reporter.progress(Progress(epoch=1, epochs=1, step=step, steps=steps))

    # On a GPU the images stay in host memory and stream through pinned staging buffers (an
    # evaluation reads each image once: no point in a resident copy).
    batches = (StagedBatches(data.images, data.labels, device, capacity=batch_size) if cuda
               else ResidentBatches(data.images, data.labels, device))
    measured = measure(model, batches, len(meta.classes), mean=mean, std=std, device=device,
                       channels_last=precision.channels_last, autocast=lambda: autocast(device, precision.amp_dtype), backoff=backoff,
                       batch_size=batch_size, label_map=label_map, should_stop=ctx.should_stop, on_batch=progress)
    if measured is None:
        raise JobFailed(f"dataset {job.dataset} has no images to evaluate on")
    result = measured.result(meta.classes, job.dataset, evaluation_split(record))
    ctx.set_evaluation(result.model_dump())
    return JobOutcome()

