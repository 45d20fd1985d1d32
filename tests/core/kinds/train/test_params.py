"""A training job's params (core/kinds/train/params.py): the batch a device type runs it with and the
batch it validates in (each rule written once), what it tells the store, and an older record read
back as it ran."""

from __future__ import annotations

from core.defaults import EVAL_BATCH, LEGACY_WEIGHT_DECAY, TRAIN_BATCH_SIZE
from core.kinds.train.params import TrainingParams, schedule_for, train_batch, validation_batch
from tests.core.kinds.examples import train_params


def test_the_batch_is_the_jobs_else_its_device_types() -> None:
    asked = train_params(batch_size=48)
    assert (asked.batch_for("cuda"), asked.batch_for("cpu")) == (48, 48)
    left_open = train_params()
    assert left_open.batch_size is None  # decided on the worker, by its device type
    assert (left_open.batch_for("cuda"), left_open.batch_for("cpu")) == (TRAIN_BATCH_SIZE["cuda"], TRAIN_BATCH_SIZE["cpu"])
    assert train_batch(None, "cpu") == TRAIN_BATCH_SIZE["cpu"] and train_batch(7, "cuda") == 7


def test_it_validates_in_batches_of_at_least_the_evaluation_batch() -> None:
    assert validation_batch(EVAL_BATCH // 4) == EVAL_BATCH  # no gradients are kept: more fit
    assert validation_batch(EVAL_BATCH * 2) == EVAL_BATCH * 2  # never fewer than it trains in
    assert train_params(batch_size=EVAL_BATCH * 2).eval_batch_for("cpu") == EVAL_BATCH * 2
    assert train_params(batch_size=8).eval_batch_for("cuda") == EVAL_BATCH


def test_what_it_tells_the_store() -> None:
    gang = train_params(epochs=3, batch_size=64, world_size=4, elastic=True)
    assert (gang.gang_size, gang.total_epochs) == (4, 3)
    assert (train_params().gang_size, train_params(epochs=2).total_epochs) == (1, 2)


def test_a_record_from_before_the_recipe_reads_back_as_it_ran() -> None:
    """Stored before the recipe and before the input was resolved at submit: the legacy recipe's
    values, the optimizer's legacy weight decay, the input derived from the model as it was."""
    old = TrainingParams.model_validate({"epochs": 2, "batch_size": None, "learning_rate": 0.01, "optimizer": "adamw",
                                         "seed": 0, "val_fraction": 0.1, "image_size": 48, "augment": False})
    assert (old.schedule, old.patience, old.keep, old.min_schedule_steps) == ("constant", 0, "last", 0)
    assert old.weight_decay == LEGACY_WEIGHT_DECAY["adamw"]
    assert old.input_for("resnet18") == (3, 48, 48) and old.input_for("cifar_net") == (3, 32, 32)
    assert schedule_for(old, 10) == "constant"


def test_the_default_schedule_needs_room() -> None:
    params = train_params()
    assert schedule_for(params, params.min_schedule_steps - 1) == "constant"
    assert schedule_for(params, params.min_schedule_steps) == params.schedule
    asked = train_params(schedule="onecycle")
    assert schedule_for(asked, 1) == "onecycle"  # a schedule asked for by name always applies
