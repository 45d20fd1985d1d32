"""Admission: will a training job fit in the memory of a worker that may take it? Decided at submit.

A valid spec can still need more memory than any worker has (`resnet18` on `fake` at
image_size 512 builds tens of GB of float temporaries; `cifar10` at 512 is 39 GB of uint8 plus a
copy); the job would then be killed by the kernel hours into the queue, or take Redis with it.
So the API estimates what the job holds resident on a worker, the way worker/data/datasets.py and
worker/training/trainer.py hold it, and refuses (422) a job that fits none of the live workers that could
take it, saying why and what would fit (the largest image_size or batch_size).

The estimate, in bytes, for N images of E = C×H×W values, batch B, P parameters:

    dataset          2·N·E     the uint8 dataset, and the train/val split the trainer copies out of it
    preparation      the peak while the data is built, before the split copies:
                     fake: 12·N·E (three float32 N×E temporaries of worker/data.fake_images)
                     upload: 2·N·E (a bound: one N·E array and the chunks in flight), torchvision: 2·native + N·E
    statistics       STATS_BYTES_PER_VALUE·S·E, S = min(N_train, 20 000) (float64 copy and
                     the temporaries of preprocess.channel_stats)
    model            P·(8 + optimizer state: 4 SGD momentum, 8 Adam/AdamW) + JOB_OVERHEAD
    a batch          B·(ACTIVATION_FACTOR·A + INPUT_COPIES·4·E), A = bytes autograd saves per
                     image, traced on the meta device (models/registry.trace_activation_bytes)
    evaluation       V·EVAL_FACTOR·A, V = the validation batch, max(B, EVAL_BATCH) (no graph is
                     kept: the live layer outputs only)

    host  = RUNTIME + max(preparation, dataset + statistics, dataset + model + max(batch, evaluation))
    a GPU = CUDA_RUNTIME + model + max(batch, evaluation)   (its host holds the data and preparation;
            whether the data also goes on the GPU is the worker's choice, made only when it fits)

The constants were measured (scripts/measure_job_memory.py: peak RSS of the real worker/data/datasets.py and
worker/training/trainer.py code in fresh CPU processes, torch 2.14.1; the table is in docs/security.md).
Everything is in float32 sizes; on a GPU (and a CPU with native bf16) the worker trains under
bf16 autocast, which holds less, so the estimate errs on the side of refusing (a calibration run
on such a CPU measures bf16 unless its plans are set to fp32). What a worker has:
`memory_total_bytes` of its device (a CPU worker's RAM), `host_memory_total_bytes` of its host,
less `admission_headroom`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from core.config import Settings
from core.datasets import DatasetRecord, split_sizes
from core.errors import InvalidInput
from core.kinds.train.params import TrainingParams, train_batch, validation_batch
from core.schemas import Device
from models.registry import ModelSpec

GiB = 1024**3
# Measured (scripts/measure_job_memory.py, CPU, torch 2.14.1; figures in docs/security.md).
RUNTIME_BYTES = 600 * 1024**2  # a worker process with torch, Celery and the inference thread, idle
CUDA_RUNTIME_BYTES = 1 * GiB  # CUDA context, cuDNN/cuBLAS workspaces (not measured here: no GPU)
# Each factor below is set at or above the highest ratio the calibration found (docs/benchmarks.md,
# "Figures that were quoted in code comments"), so the estimate errs on the side of refusing.
ACTIVATION_FACTOR = 1.5  # peak of forward + backward over what autograd saves
EVAL_FACTOR = 0.6  # peak of an inference_mode pass over what autograd would save
INPUT_COPIES = 4  # float32 copies of a batch: normalize (2), augment (pad + crop), channels_last
# channel_stats as calibrated: a float64 copy of the split (8 bytes a value) and its temporaries. It now
# sums in chunks of worker/preprocess.STATS_CHUNK_VALUES, so this bound errs further toward refusing
# until scripts/measure_job_memory.py calibrates it again.
STATS_BYTES_PER_VALUE = 9
JOB_OVERHEAD_BYTES = 64 * 1024**2  # the first step's one-off allocations (autograd, oneDNN)
STATS_SAMPLE = 20_000
FAKE_PREP_BYTES_PER_VALUE = 13  # fake_images: three float32 N×E temporaries, then the uint8 result
OPTIMIZER_STATE_BYTES = {"sgd": 4, "adam": 8, "adamw": 8}
TORCHVISION_NATIVE_VALUES = {"cifar10": 3 * 32 * 32, "mnist": 28 * 28, "fashion_mnist": 28 * 28}


@dataclass(frozen=True)
class JobShape:
    """What the estimate needs to know about a job."""

    model: ModelSpec
    dataset: DatasetRecord
    channels: int
    image_size: int
    batch_size: int | None  # None: the device's default
    optimizer: str
    val_fraction: float


@dataclass(frozen=True)
class MemoryNeed:
    host_bytes: int
    device_bytes: int  # a GPU's; 0 on a CPU worker (everything is host memory)
    parts: dict[str, int]  # what the biggest terms are, for the message

    def describe(self) -> str:
        top = sorted(self.parts.items(), key=lambda kv: -kv[1])[:3]
        return ", ".join(f"{name} {_gib(size)}" for name, size in top if size > 0)


def activation_bytes_per_image(model: ModelSpec, height: int, width: int) -> float:
    """What autograd saves per image in a training forward pass (at the model's input channels).
    For a resizable model it grows with the input's area (traced: ResNet-18 652 bytes per pixel from
    32² to 512², MobileNetV3-Small 359 plus 47 KB), so the two traces of ModelSpec.activation_bytes
    (at the input size and twice it) give every size: a + b·H·W."""
    if model.input.fixed_size:
        return model.activation_bytes[0]
    small, large = model.input.height, 2 * model.input.height
    a_small, a_large = model.activation_bytes
    per_pixel = (a_large - a_small) / (large * large - small * small)
    return max(0.0, a_small + per_pixel * (height * width - small * small))


def estimate(shape: JobShape, device_type: str) -> MemoryNeed:
    """What `shape` holds on a worker of `device_type` ("cpu" or "cuda"), in bytes."""
    spec = shape.model
    size = spec.input.height if spec.input.fixed_size else shape.image_size
    height, width = (size, size) if not spec.input.fixed_size else (spec.input.height, spec.input.width)
    values = shape.channels * height * width
    n = shape.dataset.num_images or 0
    n_train, _ = split_sizes(n, shape.val_fraction)
    batch = train_batch(shape.batch_size, device_type)
    val_batch = validation_batch(batch)
    dataset = 2 * n * values
    preparation = _preparation_bytes(shape.dataset, n, values)
    statistics = STATS_BYTES_PER_VALUE * min(n_train, STATS_SAMPLE) * values
    parameters = spec.parameters
    model = parameters * (8 + OPTIMIZER_STATE_BYTES.get(shape.optimizer, 8))
    activations = activation_bytes_per_image(spec, height, width)
    batch_bytes = int(min(batch, max(n_train, 1)) * (ACTIVATION_FACTOR * activations + INPUT_COPIES * 4 * values))
    n_val = max(n - n_train, 0)
    val_batch_bytes = int(min(val_batch, n_val) * EVAL_FACTOR * activations)
    compute = JOB_OVERHEAD_BYTES + model + max(batch_bytes, val_batch_bytes)
    parts = {"the dataset (held twice)": dataset, "building the dataset": preparation,
             "its statistics": statistics, f"a batch of {batch}": batch_bytes,
             f"evaluation batches of {val_batch}": val_batch_bytes, "the model and optimizer": model}
    if device_type == "cuda":
        host = RUNTIME_BYTES + max(preparation, dataset + statistics)
        return MemoryNeed(host, CUDA_RUNTIME_BYTES + compute, parts)
    host = RUNTIME_BYTES + max(preparation, dataset + statistics, dataset + compute)
    return MemoryNeed(host, 0, parts)


def _preparation_bytes(dataset: DatasetRecord, n: int, values: int) -> int:
    if dataset.kind == "fake":
        return FAKE_PREP_BYTES_PER_VALUE * n * values
    if dataset.kind == "torchvision":
        return 2 * n * TORCHVISION_NATIVE_VALUES.get(dataset.id, values) + n * values
    return 2 * n * values


@dataclass(frozen=True)
class Capacity:
    """What a worker offers a job: its memory less the headroom."""

    device: Device
    host_bytes: int | None  # None: unknown (an older worker)
    device_bytes: int | None  # a GPU's; None on a CPU worker

    @classmethod
    def of(cls, device: Device, headroom: float) -> Capacity:
        usable = 1.0 - headroom
        if device.type == "cpu":
            total = device.host_memory_total_bytes or device.memory_total_bytes  # the first knows cgroups
            return cls(device, int(total * usable) if total else None, None)
        host = device.host_memory_total_bytes
        gpu = device.memory_total_bytes
        return cls(device, int(host * usable) if host else None, int(gpu * usable) if gpu else None)

    def shortfall(self, need: MemoryNeed) -> str | None:
        """Why `need` does not fit here, or None."""
        if self.host_bytes is not None and need.host_bytes > self.host_bytes:
            where = "RAM" if self.device.type == "cpu" else "host RAM"
            return f"{_gib(need.host_bytes)} of {where} on {self.device.id}, which has {_gib(self.host_bytes)} for a job"
        if self.device_bytes is not None and need.device_bytes > self.device_bytes:
            return (f"{_gib(need.device_bytes)} of GPU memory on {self.device.id}, which has "
                    f"{_gib(self.device_bytes)} for a job")
        return None


def check_admission(shape: JobShape, devices: Sequence[Device], settings: Settings) -> None:
    """Refuse (InvalidInput, a 422) a job that does not fit every worker that could take it.
    With no such worker known there is nothing to measure against, and the job is admitted."""
    if not settings.admission_check or not devices or not shape.dataset.num_images:
        return
    misfits = []
    for device in devices:
        capacity = Capacity.of(device, settings.admission_headroom)
        need = estimate(shape, device.type)
        why = capacity.shortfall(need)
        if why is not None:
            misfits.append((capacity, need, why))
    if not misfits:
        return
    capacity, need, why = misfits[0]
    fits_elsewhere = [d.id for d in devices if d.id not in {m[0].device.id for m in misfits}]
    message = (f"this job does not fit in memory: it needs about {why} ({need.describe()}; "
               f"TORCHYARD_ADMISSION_HEADROOM={settings.admission_headroom:g} is kept free).")
    advice = _what_fits(shape, capacity)
    if advice:
        message += f" What fits there: {advice}."
    if fits_elsewhere:
        message += f" It fits on {', '.join(fits_elsewhere)}: submit with device set to one of them."
    raise InvalidInput(message)


def _what_fits(shape: JobShape, capacity: Capacity) -> str:
    spec = shape.model
    device_type = capacity.device.type
    batch = train_batch(shape.batch_size, device_type)

    def fits(image_size: int, batch_size: int) -> bool:
        trial = JobShape(shape.model, shape.dataset, shape.channels, image_size, batch_size, shape.optimizer,
                         shape.val_fraction)
        return capacity.shortfall(estimate(trial, device_type)) is None

    advice = []
    if not spec.input.fixed_size:
        size = _largest(lambda s: fits(s, batch), 16, shape.image_size - 1)
        if size:
            advice.append(f"image_size up to {size} at batch_size {batch}")
    largest_batch = _largest(lambda b: fits(shape.image_size, b), 1, batch - 1)
    if largest_batch:
        advice.append(f"batch_size up to {largest_batch} at image_size {shape.image_size}")
    if not advice:
        return "nothing at this image_size or a smaller batch: the data alone is too large; use fewer or smaller images"
    return "; or ".join(advice)


def _largest(fits: Callable[[int], bool], low: int, high: int) -> int | None:
    """The largest value in [low, high] for which `fits` holds (monotone: smaller fits better)."""
    if high < low or not fits(low):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


def _gib(size: int) -> str:
    return f"{size / GiB:.1f} GiB" if size >= GiB / 10 else f"{math.ceil(size / 1024**2)} MiB"


def job_shape(model: ModelSpec, dataset: DatasetRecord, params: TrainingParams) -> JobShape:
    return JobShape(model, dataset, model.input.channels, params.image_size, params.batch_size, params.optimizer,
                    params.val_fraction)
