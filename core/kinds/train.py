"""A `train` job: its request (`JobSpec`, POST /jobs), its hyper-parameters (`TrainingParams`) and
their resolution: every default decided here, once, at submit.

The API resolves a `JobSpec` into `TrainingParams` when the job is accepted and stores them with
the job (`Job.params`); the worker reads what is stored and never re-decides a default, so the
record says exactly what ran (nanoGPT keeps its defaults in one block and saves them with the
checkpoint the same way). The defaults themselves are core/defaults.py's table. What depends on
the device that takes the job (the batch size when none was asked for, mixed precision, data
placement) is the worker's choice, recorded beside the params (worker/trainer.py `plan_training`).

The field defaults of `TrainingParams` are `LEGACY_RECIPE`'s: what a job stored before the recipe
existed ran with; they apply only when an older record is read back.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from core import defaults
from core.defaults import (
    LEARNING_RATE,
    LEGACY_RECIPE,
    LEGACY_WEIGHT_DECAY,
    RECIPE,
    TRAIN_BATCH_SIZE,
    WEIGHT_DECAY,
    Keep,
    Monitor,
    Optimizer,
    Schedule,
    per_device,
)
from core.errors import InvalidInput
from core.schemas import DATASET_DESCRIPTION, DEVICE_DESCRIPTION, Job, JobKind
from models.registry import MODELS, UnknownModel, get_model_spec

# The most devices one job may ask for (POST /jobs `world_size`): far beyond any host, bounded so a
# request cannot make the scheduler walk an absurd list.
MAX_WORLD_SIZE = 256


def _per_optimizer(table: dict[str, float]) -> str:
    return ", ".join(f"{name} {value:g}" for name, value in table.items())


class JobSpec(BaseModel):
    """What a user asks for in POST /jobs. Everything but model and dataset has a default; a field
    left out (or null) takes the default `resolve_params` decides at submit (core/defaults.py's table)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    kind: Literal[JobKind.train] = JobKind.train
    model: str = Field(min_length=1, max_length=64)
    dataset: str = Field(min_length=1, max_length=200, description=DATASET_DESCRIPTION)
    epochs: int = Field(default=defaults.EPOCHS, ge=1, le=1000)
    batch_size: int | None = Field(default=None, ge=1, le=8192,
                                   description=f"Default: {per_device(TRAIN_BATCH_SIZE)}.")
    learning_rate: float | None = Field(default=None, gt=0, le=10, description="Default: per optimizer ("
                                        + _per_optimizer(LEARNING_RATE) + "). With a schedule, the peak learning rate.")
    optimizer: defaults.Optimizer | None = Field(default=None, description=f"Default: {RECIPE.optimizer}.")
    device: str = Field(default=defaults.DEVICE, max_length=200, description=DEVICE_DESCRIPTION)
    seed: int = Field(default=defaults.SEED, ge=0, le=2**31 - 1)
    val_fraction: float = Field(default=defaults.VAL_FRACTION, ge=0.0, lt=1.0)
    image_size: int | None = Field(default=None, ge=16, le=512, description="Square input size for resizable models.")
    augment: bool | None = Field(default=None, description="Random crop (4-pixel reflected padding) and horizontal "
                                 f"flip drawn per image, on the device. Default: {'on' if RECIPE.augment else 'off'}.")
    # --- the training recipe (docs/training.md says what each default is and why) ---------
    schedule: defaults.Schedule | None = Field(
        default=None, description=f"Learning-rate schedule, stepped every step. Default: {RECIPE.schedule} (after a "
                                  f"linear warm-up) when the run has at least {RECIPE.min_schedule_steps} optimizer "
                                  "steps; a shorter run keeps the rate constant, and its device_choices record `constant`.")
    warmup_fraction: float | None = Field(default=None, ge=0.0, lt=1.0, description="Share of the steps spent "
                                          "warming up (onecycle's rise, cosine's linear warm-up). Default: "
                                          f"{RECIPE.warmup_fraction['cosine']:g} (cosine), "
                                          f"{RECIPE.warmup_fraction['onecycle']:g} (onecycle).")
    weight_decay: float | None = Field(default=None, ge=0.0, le=1.0,
                                       description=f"Default: per optimizer ({_per_optimizer(WEIGHT_DECAY)}).")
    label_smoothing: float | None = Field(default=None, ge=0.0, lt=1.0,
                                          description=f"Default: {RECIPE.label_smoothing:g} (off).")
    patience: int | None = Field(default=None, ge=0, le=1000, description="Early stopping: stop after this many "
                                 f"epochs without a better `monitor`; 0 turns it off. Default: {RECIPE.patience}.")
    monitor: defaults.Monitor | None = Field(
        default=None, description=f"What early stopping and the best epoch are judged by. Default: {RECIPE.monitor} "
                                  "(ties broken by the lower val_loss).")
    keep: defaults.Keep | None = Field(default=None, description="Which weights the checkpoint keeps: "
                                                 "the best validation epoch's or the last epoch's. "
                                                 f"Default: {RECIPE.keep}.")
    init_from: str | None = Field(default=None, min_length=1, max_length=128, description="Start from the weights "
                                  "of this succeeded job (same model); a new classifier head when classes differ.")
    pretrained: bool = Field(default=False, description="Start from torchvision's ImageNet weights (resnet18, "
                             "mobilenet_v3_small), with their preprocessing.")
    precision: defaults.Precision = Field(
        default=defaults.PRECISION, description="auto: mixed precision where the device computes it natively (bf16 "
                                    "on CUDA 8.0+ and on CPUs with native bf16, fp16 with a gradient scaler on CUDA "
                                    "7.x); fp32: full precision everywhere (results reproducible to fp32 rounding, "
                                    "e.g. across world sizes), at the speed mixed precision would have saved. "
                                    f"Default: {defaults.PRECISION}.")
    # --- data-parallel training on several devices (docs/training.md "One job on many devices") ---
    world_size: int = Field(default=defaults.WORLD_SIZE, ge=1, le=MAX_WORLD_SIZE, description="Devices that train "
                            "the job together (DistributedDataParallel, one rank per worker); batch_size is the "
                            "global batch.")
    elastic: bool = Field(default=False, description="After a fault, resume with fewer devices when fewer are free "
                          "(the global batch and the schedule are kept).")


class TrainingParams(BaseModel):
    """The resolved hyper-parameters, as stored with the job."""

    # A record written before device choices had a field of their own (core/schemas.DeviceChoices)
    # carries them in its params; reading them back ignores those.
    model_config = ConfigDict(extra="ignore")

    epochs: int
    batch_size: int | None  # None: the worker picks defaults.TRAIN_BATCH_SIZE for its device type
    learning_rate: float
    optimizer: Optimizer
    seed: int
    val_fraction: float
    image_size: int
    augment: bool
    # The recipe's fields. Defaults here = what records made before them ran with (see above).
    schedule: Schedule = LEGACY_RECIPE.schedule
    warmup_fraction: float = LEGACY_RECIPE.warmup_fraction[LEGACY_RECIPE.schedule]
    min_schedule_steps: int = LEGACY_RECIPE.min_schedule_steps  # fewer optimizer steps: the rate stays constant
    weight_decay: float | None = None  # older records: filled in below from their optimizer
    label_smoothing: float = LEGACY_RECIPE.label_smoothing
    patience: int = LEGACY_RECIPE.patience
    monitor: Monitor = LEGACY_RECIPE.monitor
    keep: Keep = LEGACY_RECIPE.keep
    # Where the first weights come from (lineage; also in the checkpoint's metadata).
    init_from: str | None = None
    pretrained: bool = False
    # "auto": the device's native mixed precision (worker/recipe.choose_precision); "fp32": none.
    precision: defaults.Precision = defaults.PRECISION
    # Data-parallel training (worker/gang_training.py): ranks asked for; resume with fewer after a fault.
    world_size: int = defaults.WORLD_SIZE
    elastic: bool = False
    # The input the images are loaded at (the model's channels; image_size square, or a fixed-size
    # model's own), and the shorter side they are resized to before a centre crop when the starting
    # weights were trained that way (pretrained, or a parent that was). None in records made before
    # they were resolved at submit: `input_for` derives them the same way.
    channels: int | None = None
    height: int | None = None
    width: int | None = None
    resize_size: int | None = None

    @model_validator(mode="after")
    def _legacy_weight_decay(self) -> TrainingParams:
        if self.weight_decay is None:  # a record from before the recipe
            self.weight_decay = LEGACY_WEIGHT_DECAY[self.optimizer]
        return self

    @property
    def decay(self) -> float:
        return self.weight_decay or 0.0

    def input_for(self, model: str) -> tuple[int, int, int]:
        """(channels, height, width): as resolved at submit, or for an older record as it would have been."""
        if self.channels is not None and self.height is not None and self.width is not None:
            return self.channels, self.height, self.width
        return _input_shape(model, self.image_size)


def _input_shape(model: str, image_size: int) -> tuple[int, int, int]:
    spec = get_model_spec(model)
    if spec.input.fixed_size:
        return spec.input.channels, spec.input.height, spec.input.width
    return spec.input.channels, image_size, image_size


def _resize_size(spec: JobSpec, parent: Job | None, height: int) -> int | None:
    """The shorter side to resize to before the centre crop: the starting weights' ratio (ImageNet's
    256/224 for pretrained ones, the parent's for init_from), none when they were trained without one."""
    weights = get_model_spec(spec.model).pretrained
    if spec.pretrained and weights is not None:
        return weights.resize_for(height)
    if parent is not None:
        resize, parent_height = parent.params.get("resize_size"), parent.params.get("height")
        if isinstance(resize, int) and isinstance(parent_height, int) and parent_height:
            return round(height * resize / parent_height)
    return None


def resolve_params(spec: JobSpec, parent: Job | None = None) -> TrainingParams:
    """Every hyper-parameter of `spec` with its value. `parent` is the job `init_from` names
    (already checked by core/submission.py): the child keeps its image size unless it asks for
    another. Raises InvalidInput for an unknown model, an image_size the architecture cannot take,
    or pretrained weights the architecture does not have."""
    try:
        model = get_model_spec(spec.model)
    except UnknownModel:
        raise InvalidInput(f"unknown model {spec.model!r}; available: {', '.join(MODELS)}") from None
    if spec.image_size is not None and model.input.fixed_size and spec.image_size != model.input.height:
        raise InvalidInput(f"{spec.model} takes {model.input.height}×{model.input.width} input only; "
                           f"leave image_size unset")
    if spec.pretrained and spec.init_from:
        raise InvalidInput("give either init_from or pretrained, not both: init_from already starts from "
                           "that job's weights")
    if spec.pretrained and model.pretrained is None:
        with_weights = [name for name, m in MODELS.items() if m.pretrained is not None]
        raise InvalidInput(f"{spec.model} has no pretrained weights; pretrained works with {', '.join(with_weights)}")
    image_size = spec.image_size or _inherited_size(parent) or (
        model.pretrained.crop_size if spec.pretrained and model.pretrained else model.input.height)
    optimizer = spec.optimizer or RECIPE.optimizer
    schedule = spec.schedule or RECIPE.schedule
    _check_global_batch(spec.batch_size, spec.world_size)
    channels, height, width = _input_shape(spec.model, image_size)
    return TrainingParams(
        epochs=spec.epochs, batch_size=spec.batch_size,
        learning_rate=spec.learning_rate or defaults.LEARNING_RATE[optimizer], optimizer=optimizer,
        seed=spec.seed, val_fraction=spec.val_fraction, image_size=image_size,
        augment=RECIPE.augment if spec.augment is None else spec.augment,
        schedule=schedule, min_schedule_steps=0 if spec.schedule else RECIPE.min_schedule_steps,
        warmup_fraction=_given(spec.warmup_fraction, RECIPE.warmup_fraction[schedule]),
        weight_decay=_given(spec.weight_decay, defaults.WEIGHT_DECAY[optimizer]),
        label_smoothing=_given(spec.label_smoothing, RECIPE.label_smoothing),
        patience=_given(spec.patience, RECIPE.patience),
        monitor=spec.monitor or RECIPE.monitor, keep=spec.keep or RECIPE.keep,
        init_from=spec.init_from, pretrained=spec.pretrained, precision=spec.precision, world_size=spec.world_size,
        elastic=spec.elastic, channels=channels, height=height, width=width,
        resize_size=_resize_size(spec, parent, height),
    )


def _check_global_batch(batch_size: int | None, world_size: int) -> None:
    """`batch_size` is the global batch: each of `world_size` ranks takes an equal share of it (the
    last, shorter batch of an epoch is split as evenly as it goes). Left open, the worker's default
    for its device must divide too."""
    if world_size == 1:
        return
    if batch_size is None:
        if any(size % world_size for size in defaults.TRAIN_BATCH_SIZE.values()):
            raise InvalidInput(f"world_size {world_size}: give batch_size (the global batch), divisible by "
                               f"{world_size}; the defaults ({', '.join(map(str, defaults.TRAIN_BATCH_SIZE.values()))}) "
                               f"are not")
        return
    if batch_size % world_size:
        raise InvalidInput(f"batch_size {batch_size} is the global batch and must divide by world_size "
                           f"{world_size} (each rank takes batch_size / world_size images); try "
                           f"{max(world_size, batch_size - batch_size % world_size)}")


def schedule_for(params: TrainingParams, total_steps: int) -> Schedule:
    """The schedule a run of `total_steps` optimizer steps uses (the worker knows the steps only
    once its batch size and the data are known; the rule is decided here, with the defaults)."""
    return "constant" if total_steps < params.min_schedule_steps else params.schedule


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value


def _inherited_size(parent: Job | None) -> int | None:
    if parent is None:
        return None
    size = parent.params.get("image_size")
    return int(size) if isinstance(size, int | float) else None
