"""What POST /jobs takes for a training job (`JobSpec`): every field but model and dataset has a
default, which core/kinds/train/resolution.py decides at submit from core/defaults.py's table."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from core import defaults
from core.defaults import LEARNING_RATE, RECIPE, TRAIN_BATCH_SIZE, WEIGHT_DECAY, per_device
from core.schemas import DATASET_DESCRIPTION, DEVICE_DESCRIPTION, JobKind

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
    priority: Literal["low", "normal", "high"] = Field(
        default="normal", description="Its place among its project's queued jobs: high before normal before low "
                                      "(between projects, fair share decides: core/access/fair_share.py).")
