"""The HTTP contract states the defaults the code decides: GET /openapi.json's schemas (defaults and
description texts) read against core/defaults.py's table, and the table against what a bare
submission resolves to (the schedule's text once said onecycle and a predict job's CPU batch 64,
while jobs ran cosine/constant and 128; hence one table for all of them). The numbers are read back
out of the served text, so a description written by hand with another number fails here."""

from __future__ import annotations

import re
from typing import Any

import pytest

from app.main import create_app
from core import defaults
from core.config import Settings
from core.defaults import EVAL_BATCH, PREDICT_BATCH_SIZE, RECIPE, TOP_K, TRAIN_BATCH_SIZE
from core.kinds.train import JobSpec, resolve_params


@pytest.fixture(scope="module")
def openapi() -> dict[str, Any]:
    """The document GET /openapi.json serves (the app's own, built without Redis)."""
    return create_app(Settings(_env_file=None, redis_url="redis://127.0.0.1:1/0")).openapi()


def _field(openapi: dict[str, Any], model: str, field: str) -> dict[str, Any]:
    return openapi["components"]["schemas"][model]["properties"][field]


def _default_in(text: str) -> str:
    found = re.search(r"Default: (.+?)(?:\.$|\. | \(|$)", text)
    assert found, f"no 'Default:' in {text!r}"
    return found.group(1).strip('"')


def _per_device(text: str) -> dict[str, int]:
    found = re.search(r"Default: (\d+) on a GPU, (\d+) on a CPU", text)
    assert found, f"no per-device default in {text!r}"
    return {"cuda": int(found.group(1)), "cpu": int(found.group(2))}


def _per_optimizer(text: str) -> dict[str, float]:
    found = re.search(r"per optimizer \(([^)]*)\)", text)
    assert found, f"no per-optimizer defaults in {text!r}"
    return {name: float(value) for name, value in (part.split() for part in found.group(1).split(", "))}


def test_training_defaults_as_served(openapi: dict[str, Any]) -> None:
    def says(field: str) -> str:
        return _field(openapi, "JobSpec", field).get("description", "")

    assert _per_device(says("batch_size")) == TRAIN_BATCH_SIZE
    assert _per_optimizer(says("learning_rate")) == defaults.LEARNING_RATE
    assert _per_optimizer(says("weight_decay")) == defaults.WEIGHT_DECAY
    assert _default_in(says("optimizer")) == RECIPE.optimizer
    assert _default_in(says("schedule")).startswith(RECIPE.schedule)
    assert f"at least {RECIPE.min_schedule_steps} optimizer steps" in says("schedule")
    assert f"{RECIPE.warmup_fraction['cosine']:g} (cosine)" in says("warmup_fraction")
    assert f"{RECIPE.warmup_fraction['onecycle']:g} (onecycle)" in says("warmup_fraction")
    assert float(_default_in(says("label_smoothing"))) == RECIPE.label_smoothing
    assert int(_default_in(says("patience"))) == RECIPE.patience
    assert _default_in(says("monitor")) == RECIPE.monitor
    assert _default_in(says("keep")) == RECIPE.keep
    assert _default_in(says("augment")) == ("on" if RECIPE.augment else "off")
    assert _default_in(says("precision")) == defaults.PRECISION
    served = {name: _field(openapi, "JobSpec", name).get("default")
              for name in ("epochs", "seed", "val_fraction", "device", "precision", "world_size")}
    assert served == {"epochs": defaults.EPOCHS, "seed": defaults.SEED, "val_fraction": defaults.VAL_FRACTION,
                      "device": defaults.DEVICE, "precision": defaults.PRECISION, "world_size": defaults.WORLD_SIZE}


def test_evaluate_and_predict_defaults_as_served(openapi: dict[str, Any]) -> None:
    assert int(_default_in(_field(openapi, "EvaluateSpec", "batch_size")["description"])) == EVAL_BATCH
    assert _per_device(_field(openapi, "BatchPredictSpec", "batch_size")["description"]) == PREDICT_BATCH_SIZE
    top_k = _field(openapi, "BatchPredictSpec", "top_k")
    assert (top_k["default"], top_k["maximum"]) == (TOP_K, defaults.MAX_TOP_K)
    assert int(_default_in(top_k["description"])) == TOP_K
    form = openapi["paths"]["/predict"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert form["properties"]["top_k"]["default"] == TOP_K
    assert int(_default_in(form["properties"]["top_k"]["description"])) == TOP_K
    for model in ("JobSpec", "EvaluateSpec", "BatchPredictSpec"):
        assert _field(openapi, model, "device")["default"] == defaults.DEVICE


def test_a_bare_submission_resolves_to_the_table() -> None:
    """What the descriptions promise is what a job left to its defaults is stored with."""
    params = resolve_params(JobSpec(model="cifar_net", dataset="fake"))
    assert (params.optimizer, params.schedule, params.monitor, params.keep) == (
        RECIPE.optimizer, RECIPE.schedule, RECIPE.monitor, RECIPE.keep)
    assert params.learning_rate == defaults.LEARNING_RATE[RECIPE.optimizer]
    assert params.weight_decay == defaults.WEIGHT_DECAY[RECIPE.optimizer]
    assert params.warmup_fraction == RECIPE.warmup_fraction[RECIPE.schedule]
    assert (params.patience, params.label_smoothing, params.augment) == (RECIPE.patience, RECIPE.label_smoothing,
                                                                        RECIPE.augment)
    assert (params.epochs, params.seed, params.val_fraction, params.precision) == (
        defaults.EPOCHS, defaults.SEED, defaults.VAL_FRACTION, defaults.PRECISION)
    assert params.batch_size is None  # the device type's: TRAIN_BATCH_SIZE, recorded in its device choices
