"""A training job's params (`TrainingParams`): its hyper-parameters as resolved once at submit and
stored with the job (`Job.params`), and the rules read from them: the batch a device type runs it
with, the batch it validates in, the schedule a run of so many steps uses.

The worker reads what is stored and never re-decides a default, so the record says exactly what
ran (nanoGPT keeps its defaults in one block and saves them with the checkpoint the same way).
What depends on the device that takes the job (the batch size when none was asked for, mixed
precision, data placement) is the worker's choice, recorded beside the params (worker/training/trainer.py
`plan_training`, core/schemas.DeviceChoices).

The field defaults of `TrainingParams` are `LEGACY_RECIPE`'s: what a job stored before the recipe
existed ran with; they apply only when an older record is read back.
"""

from __future__ import annotations

from pydantic import ConfigDict, model_validator

from core import defaults
from core.defaults import (
    EVAL_BATCH,
    LEGACY_RECIPE,
    LEGACY_WEIGHT_DECAY,
    TRAIN_BATCH_SIZE,
    Keep,
    Monitor,
    Optimizer,
    Schedule,
)
from core.kinds.params import KindParams
from core.schemas import JobKind
from models.registry import ModelSpec, get_model_spec


def train_batch(batch_size: int | None, device_type: str) -> int:
    """The global batch a training job runs with on a device of `device_type`: the one it asked for,
    else the type's default (a GPU keeps busy with bigger batches)."""
    return batch_size or TRAIN_BATCH_SIZE[device_type]


def validation_batch(train_batch: int) -> int:
    """The batch a training job of global batch `train_batch` validates in: no gradients are kept, so
    at least EVAL_BATCH."""
    return max(train_batch, EVAL_BATCH)


class TrainingParams(KindParams):
    """The resolved hyper-parameters, as stored with the job."""

    # A record written before device choices had a field of their own (core/schemas.DeviceChoices)
    # carries them in its params; reading them back ignores those.
    model_config = ConfigDict(extra="ignore")
    kind = JobKind.train

    epochs: int
    batch_size: int | None  # None: the device type's (`batch_for`), chosen on the worker
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
    # Data-parallel training (worker/gang/training.py): ranks asked for; resume with fewer after a fault.
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
        return input_shape(get_model_spec(model), self.image_size)

    def batch_for(self, device_type: str) -> int:
        return train_batch(self.batch_size, device_type)

    def eval_batch_for(self, device_type: str) -> int:
        return validation_batch(self.batch_for(device_type))

    @property
    def gang_size(self) -> int:
        return self.world_size

    @property
    def total_epochs(self) -> int:
        return self.epochs


def input_shape(model: ModelSpec, image_size: int) -> tuple[int, int, int]:
    """(channels, height, width) a job of `model` at `image_size` loads its images at."""
    if model.input.fixed_size:
        return model.input.channels, model.input.height, model.input.width
    return model.input.channels, image_size, image_size


def schedule_for(params: TrainingParams, total_steps: int) -> Schedule:
    """The schedule a run of `total_steps` optimizer steps uses (the worker knows the steps only
    once its batch size and the data are known; the rule is decided here, with the defaults)."""
    return "constant" if total_steps < params.min_schedule_steps else params.schedule
