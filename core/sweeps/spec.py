"""What POST /sweeps takes (`SweepSpec`) and what GET /sweeps/{id} answers (`Sweep`), and every
check of a search space that needs nothing but the request itself.

A search space names fields of a training job (core/kinds/train/spec.JobSpec) and, for each, a
range or a list of choices. Each bound and each choice is checked here by building the training
body it would give: a value a training job would refuse is refused now, with a 422 naming the
space's field, rather than as a trial that fails later. The checks against the world (the base
body's model, dataset, devices and memory) are the training submitter's, made once at submit."""

from __future__ import annotations

import math
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from core import defaults
from core.errors import InvalidInput
from core.kinds.train.spec import JobSpec

# Fields of a training job a sweep may search: the recipe and the architecture. The dataset, the
# device, the seed, the validation split and the starting weights stay the base body's: a trial
# that changed them would be judged on other data or by other rules than its peers.
SEARCHABLE = ("model", "epochs", "batch_size", "learning_rate", "optimizer", "image_size", "augment", "schedule",
              "warmup_fraction", "weight_decay", "label_smoothing", "patience", "precision")
# The per-epoch values a training job logs (core/schemas.EpochMetrics) that a sweep may optimise,
# with the direction that is better for each.
METRICS: dict[str, Literal["maximize", "minimize"]] = {
    "val_accuracy": "maximize", "val_loss": "minimize", "train_accuracy": "maximize", "train_loss": "minimize"}
Metric = Literal["val_accuracy", "val_loss", "train_accuracy", "train_loss"]
Sampler = Literal["tpe", "random", "grid"]
Pruner = Literal["median", "successive_halving", "hyperband", "none"]
Choice = str | bool | int | float


class FloatRange(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["float"]
    low: float
    high: float
    log: bool = False
    step: float | None = Field(default=None, gt=0)


class IntRange(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["int"]
    low: int
    high: int
    log: bool = False
    step: int = Field(default=1, ge=1)


class Choices(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["categorical"]
    choices: list[Choice] = Field(max_length=defaults.MAX_SWEEP_CHOICES)


Range = Annotated[FloatRange | IntRange | Choices, Field(discriminator="type")]


class SweepSpec(BaseModel):
    """POST /sweeps. `base` is a POST /jobs training body; each trial is it with the space's values."""

    model_config = ConfigDict(extra="forbid")

    base: JobSpec
    space: dict[str, Range] = Field(max_length=len(SEARCHABLE))
    trials: int = Field(default=defaults.SWEEP_TRIALS, ge=1, le=defaults.MAX_SWEEP_TRIALS)
    parallel: int | None = Field(default=None, ge=1, le=defaults.MAX_SWEEP_PARALLEL,
                                 description="Trials running at once. Default: the live devices the base's "
                                             "`device` can run on (at least 1).")
    metric: Metric = "val_accuracy"
    direction: Literal["maximize", "minimize"] | None = Field(
        default=None, description="Default: maximize for an accuracy, minimize for a loss.")
    sampler: Sampler = "tpe"
    pruner: Pruner = "median"
    startup_trials: int = Field(default=defaults.SWEEP_STARTUP_TRIALS, ge=0, le=defaults.MAX_SWEEP_TRIALS,
                                description="The median pruner prunes nothing until this many trials completed.")
    warmup_epochs: int = Field(default=defaults.SWEEP_WARMUP_EPOCHS, ge=0, le=1000,
                               description="The median pruner judges no trial before this many epochs.")
    seed: int = Field(default=0, ge=0, le=2**31 - 1)

    @property
    def resolved_direction(self) -> Literal["maximize", "minimize"]:
        return self.direction or METRICS[self.metric]


def check_sweep(spec: SweepSpec) -> None:
    """Every check of the request alone (InvalidInput naming the field); the base's against the
    world is the training submitter's."""
    if not spec.space:
        raise InvalidInput("space: name at least one field of a training job to search")
    base = spec.base.model_dump(mode="json", exclude_unset=True)
    for name, rng in spec.space.items():
        where = f"space.{name}"
        if name not in JobSpec.model_fields or name == "kind":
            raise InvalidInput(f"{where}: not a field of a training job; searchable: {', '.join(SEARCHABLE)}")
        if name not in SEARCHABLE:
            raise InvalidInput(f"{where}: {name} is not searchable (every trial keeps the base's); "
                               f"searchable: {', '.join(SEARCHABLE)}")
        _check_range(where, rng)
        for label, value in _probes(rng):
            _check_value(base, name, value, f"{where}.{label}")
        if spec.sampler == "grid" and isinstance(rng, FloatRange) and rng.step is None:
            raise InvalidInput(f"{where}: the grid sampler needs a finite set of values; a continuous float range "
                               f"has none (give a step, or categorical choices)")
    if spec.sampler == "grid" and spec.trials > grid_size(spec):
        raise InvalidInput(f"trials: {spec.trials} is more than the grid's {grid_size(spec)} points")
    if spec.metric.startswith("val_") and spec.base.val_fraction == 0:
        raise InvalidInput(f"metric: {spec.metric} is not logged when base.val_fraction is 0 (no validation split); "
                           f"use a train_ metric or a val_fraction above 0")


def _check_range(where: str, rng: FloatRange | IntRange | Choices) -> None:
    if isinstance(rng, Choices):
        if not rng.choices:
            raise InvalidInput(f"{where}.choices: empty; give at least one value")
        if len({repr(c) for c in rng.choices}) != len(rng.choices):
            raise InvalidInput(f"{where}.choices: a value is listed twice")
        return
    if not (math.isfinite(rng.low) and math.isfinite(rng.high)):
        raise InvalidInput(f"{where}: low and high must be finite numbers")
    if rng.low >= rng.high:
        raise InvalidInput(f"{where}: low ({rng.low:g}) must be below high ({rng.high:g})")
    if rng.log and rng.low <= 0:
        raise InvalidInput(f"{where}: a log range must stay above 0 (low is {rng.low:g})")
    if rng.log and isinstance(rng, FloatRange) and rng.step is not None:
        raise InvalidInput(f"{where}: a log range cannot have a step")
    if rng.log and isinstance(rng, IntRange) and rng.step != 1:
        raise InvalidInput(f"{where}: a log range cannot have a step")


def _probes(rng: FloatRange | IntRange | Choices) -> list[tuple[str, Any]]:
    if isinstance(rng, Choices):
        return [(f"choices[{i}]", c) for i, c in enumerate(rng.choices)]
    return [("low", rng.low), ("high", rng.high)]


def _check_value(base: dict[str, Any], name: str, value: Any, where: str) -> None:
    """The training body this value would give is one POST /jobs accepts."""
    if isinstance(value, bool) and name != "augment":  # pydantic would read true as 1
        raise InvalidInput(f"{where}: {value!r} is not a value of {name}")
    try:
        JobSpec.model_validate({**base, name: value})
    except ValidationError as exc:
        first = exc.errors()[0]
        raise InvalidInput(f"{where}: {value!r} is not a valid {name}: {first['msg']}") from None


def grid_size(spec: SweepSpec) -> int:
    size = 1
    for rng in spec.space.values():
        size *= len(grid_values(rng))
    return size


def grid_values(rng: FloatRange | IntRange | Choices) -> list[Choice]:
    """The values a grid visits on one axis (a float range only with a step: check_sweep refused the others)."""
    if isinstance(rng, Choices):
        return list(rng.choices)
    if isinstance(rng, IntRange):
        return list(range(rng.low, rng.high + 1, rng.step))
    assert rng.step is not None
    count = math.floor((rng.high - rng.low) / rng.step + 1e-9) + 1
    return [round(rng.low + i * rng.step, 12) for i in range(min(count, defaults.MAX_SWEEP_CHOICES))]


def trial_body(base: JobSpec, params: dict[str, Any]) -> JobSpec:
    """The training body of one trial: the base with the trial's values."""
    return JobSpec.model_validate({**base.model_dump(mode="json", exclude_unset=True), **params})


# How a job's `stop_reason` says its trial was pruned: written by the worker that judged it
# (worker/training/pruning.py), read by the coordinator that tells the study.
PRUNED_PREFIX = "pruned by the sweep"


def pruned_reason(pruner: str, epoch: int, metric: str, value: float) -> str:
    return f"{PRUNED_PREFIX}'s {pruner} pruner after epoch {epoch} ({metric} {value:.4g}); the best epoch's weights are kept"


def is_pruned(stop_reason: str | None) -> bool:
    return bool(stop_reason) and str(stop_reason).startswith(PRUNED_PREFIX)


# ------------------------------------------------------------------------------ the answers
TrialState = Literal["running", "complete", "pruned", "failed"]
SweepStatus = Literal["running", "succeeded", "failed", "cancelled"]


class SweepTrial(BaseModel):
    number: int
    job_id: str | None = Field(description="Its training job; null only while the job is being created.")
    params: dict[str, Any]
    state: TrialState
    value: float | None = Field(description="The metric's best epoch value (complete), or its last (pruned).")
    epoch: int = Field(description="The last epoch the trial's job recorded.")
    job_status: str | None = None
    error: str | None = None


class Sweep(BaseModel):
    id: str
    project: str = Field(default="default", description="The project of the key that started it.")
    status: SweepStatus
    created_at: datetime
    finished_at: datetime | None = None
    message: str | None = None
    spec: dict[str, Any]
    parallel: int
    trials: list[SweepTrial] = []
    best: SweepTrial | None = None
    importances: dict[str, float] | None = Field(
        default=None, description="Once the sweep ended: each parameter's importance (Optuna's fANOVA), summing to 1.")


class SweepList(BaseModel):
    sweeps: list[Sweep]
