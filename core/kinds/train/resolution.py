"""A training job's resolution: a `JobSpec` into `TrainingParams`, every default decided here, once,
at submit (core/defaults.py's table), for the architecture looked up once (`known_model`)."""

from __future__ import annotations

from typing import Any

from core import defaults
from core.defaults import RECIPE
from core.errors import InvalidInput
from core.kinds.train.params import TrainingParams, input_shape
from core.kinds.train.spec import JobSpec
from models.registry import MODELS, ModelSpec, UnknownModel, get_model_spec


def known_model(name: str) -> ModelSpec:
    """The architecture `name` names; InvalidInput (a 422) listing the others when there is none."""
    try:
        return get_model_spec(name)
    except UnknownModel:
        raise InvalidInput(f"unknown model {name!r}; available: {', '.join(MODELS)}") from None


def resolve_params(spec: JobSpec, model: ModelSpec | None = None, parent: TrainingParams | None = None) -> TrainingParams:
    """Every hyper-parameter of `spec` with its value. `model` is `spec.model`'s architecture (looked
    up here when not given); `parent` the params of the job `init_from` names (already checked by
    core/kinds/train/submit.py): the child keeps its image size unless it asks for another. Raises
    InvalidInput for an unknown model, an image_size the architecture cannot take, or pretrained
    weights the architecture does not have."""
    model = model or known_model(spec.model)
    if spec.image_size is not None and model.input.fixed_size and spec.image_size != model.input.height:
        raise InvalidInput(f"{spec.model} takes {model.input.height}×{model.input.width} input only; "
                           f"leave image_size unset")
    if spec.pretrained and spec.init_from:
        raise InvalidInput("give either init_from or pretrained, not both: init_from already starts from "
                           "that job's weights")
    if spec.pretrained and model.pretrained is None:
        with_weights = [name for name, m in MODELS.items() if m.pretrained is not None]
        raise InvalidInput(f"{spec.model} has no pretrained weights; pretrained works with {', '.join(with_weights)}")
    image_size = spec.image_size or (parent.image_size if parent is not None else None) or (
        model.pretrained.crop_size if spec.pretrained and model.pretrained else model.input.height)
    optimizer = spec.optimizer or RECIPE.optimizer
    schedule = spec.schedule or RECIPE.schedule
    _check_global_batch(spec.batch_size, spec.world_size)
    channels, height, width = input_shape(model, image_size)
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
        resize_size=_resize_size(spec, model, parent, height),
    )


def _resize_size(spec: JobSpec, model: ModelSpec, parent: TrainingParams | None, height: int) -> int | None:
    """The shorter side to resize to before the centre crop: the starting weights' ratio (ImageNet's
    256/224 for pretrained ones, the parent's for init_from), none when they were trained without one."""
    if spec.pretrained and model.pretrained is not None:
        return model.pretrained.resize_for(height)
    if parent is not None and parent.resize_size and parent.height:
        return round(height * parent.resize_size / parent.height)
    return None


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


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value
