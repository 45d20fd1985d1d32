"""A training job's hyper-parameters: every default decided here, once, at submit.

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

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from core import defaults
from core.defaults import LEGACY_RECIPE, LEGACY_WEIGHT_DECAY, RECIPE, Keep, Monitor, Optimizer, Schedule
from core.errors import InvalidInput
from core.schemas import Job, JobSpec
from models.registry import MODELS, UnknownModel, get_model_spec


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
