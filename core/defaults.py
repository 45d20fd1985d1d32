"""Every job default, in one table (the way Celery keeps `celery/app/defaults.py`).

A default used to be written where it was used, and the copies drifted: the OpenAPI text said
one number, the submit-side resolution another, the worker a third. Now each is named here once,
and everything that decides or describes a default reads it from here: the resolution at submit
(core/kinds/<kind>/), the admission check (core/admission.py), the workers (worker/kinds/) and
the descriptions of the HTTP contract's fields (`Field(default=..., description=...)`), whose
agreement with this table tests/core/test_schema_defaults.py checks through GET /openapi.json.

Two sets of training defaults live here, on purpose:
- `RECIPE`: what a job submitted now gets for a field it leaves out (docs/training.md says why
  each value, with the measurements);
- `LEGACY_RECIPE`: what a job stored *before* the recipe existed ran with (constant learning
  rate, no label smoothing, no early stopping, the last epoch's weights). It applies only when
  an older record is read back, so it keeps saying what ran and a queued one resumes with the
  recipe it was submitted under.

This module imports nothing of ours: the contract's schemas, the domain and the workers all read it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

Optimizer = Literal["sgd", "adam", "adamw"]
Schedule = Literal["onecycle", "cosine", "constant"]
Monitor = Literal["val_accuracy", "val_loss"]
Keep = Literal["best", "last"]
Precision = Literal["auto", "fp32"]

# --- every kind ------------------------------------------------------------------------------
DEVICE = "auto"  # any live worker that fits (core/devices.DeviceRegistry.validate_request)

# --- train -----------------------------------------------------------------------------------
EPOCHS = 5
SEED = 0
VAL_FRACTION = 0.1
PRECISION: Precision = "auto"  # the device's native mixed precision (worker/recipe.choose_precision)
WORLD_SIZE = 1
# When a training job leaves batch_size open, the device type's: a GPU keeps busy with bigger batches.
# The only default a job's params cannot hold at submit (a job for "auto" may land on either):
# the worker records the one it used in the job's device choices (core/schemas.DeviceChoices).
TRAIN_BATCH_SIZE: dict[str, int] = {"cuda": 256, "cpu": 128}
# The peak learning rate per optimizer (the schedule rises to it and anneals from it). SGD with
# momentum 0.9 wants a larger step than Adam's family.
LEARNING_RATE: dict[str, float] = {"sgd": 0.05, "adam": 1e-3, "adamw": 1e-3}
# Decoupled weight decay for AdamW; L2 for SGD (the classic 5e-4); plain Adam couples decay with
# its adaptive step (Loshchilov & Hutter), so it gets none unless asked.
WEIGHT_DECAY: dict[str, float] = {"sgd": 5e-4, "adam": 0.0, "adamw": 0.05}


class Recipe(BaseModel):
    """The training recipe's defaults, in one block (measured in docs/training.md)."""

    model_config = ConfigDict(frozen=True)

    optimizer: Optimizer = "adamw"
    schedule: Schedule = "cosine"
    warmup_fraction: dict[str, float] = {"onecycle": 0.25, "cosine": 0.05, "constant": 0.0}
    # The default schedule needs room: on runs of 4 to 25 optimizer steps (the generated datasets,
    # and a few hundred photos at batch 128) annealing cost up to 25 points of validation accuracy
    # against a constant rate (docs/training.md), so a run shorter than this keeps the rate
    # constant. A schedule the job asks for by name always applies.
    min_schedule_steps: int = 200
    label_smoothing: float = 0.0  # measured neutral within seed noise here (docs/training.md)
    patience: int = 5  # epochs without a better monitor before stopping; 0 = never
    monitor: Monitor = "val_accuracy"
    keep: Keep = "best"
    augment: bool = False


RECIPE = Recipe()
# What records made before the recipe ran with (read back only; see the module's docstring).
LEGACY_RECIPE = Recipe(schedule="constant", warmup_fraction={"onecycle": 0.0, "cosine": 0.0, "constant": 0.0},
                       min_schedule_steps=0, patience=0, keep="last")
# Weight decay of a record from before the recipe: AdamW ran with torch's default, the others none.
LEGACY_WEIGHT_DECAY: dict[str, float] = {"sgd": 0.0, "adam": 0.0, "adamw": 0.01}

# --- evaluate (and a training job's validation passes) -----------------------------------------
# Images per evaluation forward: no gradients are kept, so more fit than in training. A training
# job validates in batches of max(its batch, EVAL_BATCH).
EVAL_BATCH = 256

# --- batch_predict (a batch-prediction job), and POST /predict ----------------------------------
TOP_K = 5  # predictions per image
MAX_TOP_K = 1000
# A batch prediction's batch per device type: larger batches spread each batch's fixed costs (the
# hand-off from the decode process, the forward's start) over more images, with diminishing
# returns; on a CPU 128 takes most of what 256 gains at half its memory (a batch's decoded images
# wait in shared memory, as many batches ahead as worker/predict_decode.PREFETCH_BATCHES). The
# figures: docs/benchmarks.md, "Figures that were quoted in code comments".
PREDICT_BATCH_SIZE: dict[str, int] = {"cuda": 256, "cpu": 128}

# --- export ------------------------------------------------------------------------------------
# Images of its dataset an export's parity check decodes and compares with the checkpoint's
# answers, in one forward (with a few of noise): enough to catch a file that computes otherwise,
# few enough to decode whatever the dataset's size.
EXPORT_PARITY_IMAGES = 32


def per_device(table: dict[str, int]) -> str:
    """How a per-device-type default reads in the contract's descriptions."""
    return f"{table['cuda']} on a GPU, {table['cpu']} on a CPU"

# --- sweeps (a hyper-parameter search: core/sweeps/) -------------------------------------------
# Trials of a sweep when the request names none, and the most one may ask for: each trial is a
# training job with its records and files, so a sweep is bounded like a queue of jobs is.
SWEEP_TRIALS = 16
MAX_SWEEP_TRIALS = 1000
# Trials running at once: beyond any host's devices, bounded so a request cannot flood the queue.
MAX_SWEEP_PARALLEL = 64
# Values one categorical axis (or a grid's axis) may list.
MAX_SWEEP_CHOICES = 100
# The median pruner's patience (Optuna's defaults): it prunes nothing until this many trials
# completed, and judges no trial before this many epochs.
SWEEP_STARTUP_TRIALS = 5
SWEEP_WARMUP_EPOCHS = 0
