"""A training job's device choices are a record of their own, beside its params, and a record
written by the previous code (the choices inside `params`, the worker having rewritten them) still
reads back and resumes: the shape below is what that code stored for a job like `make_trainer`'s
once its first delivery had started (submit's params, then `TrainingPlan.as_params()` and
`resize_size` merged over them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis
import torch

from core import keys
from core.jobs import JobStore
from core.kinds.train import JobSpec, TrainingParams, resolve_params
from core.schemas import DeviceChoices
from tests.worker.training.test_trainer import Reporter, small_fake
from worker.runtime.job_context import StopJob
from worker.training.trainer import Trainer, plan_training

LEGACY_PARAMS = {
    "epochs": 3, "batch_size": 64, "learning_rate": 0.001, "optimizer": "adamw", "seed": 0, "val_fraction": 0.2,
    "image_size": 32, "augment": False, "schedule": "constant", "warmup_fraction": 0.05, "min_schedule_steps": 200,
    "weight_decay": 0.05, "label_smoothing": 0.0, "patience": 5, "monitor": "val_accuracy", "keep": "best",
    "init_from": None, "pretrained": False, "precision": "auto", "world_size": 1, "elastic": False,
    "channels": 3, "height": 32, "width": 32, "device": "cpu", "amp_dtype": None, "grad_scaler": False,
    "channels_last": False, "cudnn_benchmark": False, "data_on_device": True, "staging_buffers": 0,
    "resize_size": None,
}


def _spec(**fields) -> JobSpec:
    return JobSpec(**{"model": "cifar_net", "dataset": "fake", "epochs": 3, "val_fraction": 0.2, "batch_size": 64,
                      "precision": "fp32", **fields})


def _trainer(tmp_path: Path, params: TrainingParams, reporter: Reporter, stop=lambda: None,
             resume_from: Path | None = None) -> Trainer:
    plan = plan_training("job1", "cifar_net", params, small_fake(200), torch.device("cpu"), 3, 32, 32)
    return Trainer(plan, small_fake(200), final_path=tmp_path / "model.pt", resume_from=resume_from,
                   resume_to=lambda epoch: tmp_path / f"resume-{epoch}.pt", reporter=reporter, should_stop=stop)


def test_the_plan_keeps_params_and_choices_apart() -> None:
    params = resolve_params(_spec(batch_size=None))
    plan = plan_training("j", "cifar_net", params, small_fake(50), torch.device("cpu"), 3, 32, 32)
    assert plan.params is params and params.batch_size is None  # never rewritten
    assert plan.device.batch_size == 128 and plan.device.device == "cpu"  # the CPU's default batch
    assert plan.device.schedule == "constant"  # a few steps: under min_schedule_steps
    assert (params.channels, params.height, params.width) == (3, 32, 32)  # resolved at submit
    with pytest.raises(ValueError):
        plan.device.batch_size = 1  # type: ignore[misc]  # a frozen record


def test_a_legacy_record_reads_back_with_its_choices(clean_redis_url: str) -> None:
    """Through the job store, as GET /jobs/{id} reads it: the params as they were stored, and the
    choices inside them shown as the job's device_choices."""
    store = JobStore(redis.Redis.from_url(clean_redis_url, decode_responses=True), lambda delivery: None)
    job, _ = store.create(model="cifar_net", dataset="fake", params=resolve_params(_spec()), requested_device="auto")
    store.redis.hset(keys.job(job.id), "params", json.dumps(LEGACY_PARAMS))  # as the previous code left it
    read = store.get(job.id)
    assert read.params == LEGACY_PARAMS
    assert read.device_choices == DeviceChoices(device="cpu", batch_size=64, schedule="constant", amp_dtype=None,
                                                grad_scaler=False, channels_last=False, cudnn_benchmark=False,
                                                data_on_device=True, staging_buffers=0)
    fresh, _ = store.create(model="cifar_net", dataset="fake", params=resolve_params(_spec()), requested_device="auto")
    assert store.get(fresh.id).device_choices is None  # not started: nothing chosen yet


def test_a_legacy_record_resumes(tmp_path: Path) -> None:
    """A delivery of the previous code stopped in epoch 2 (its resume state after epoch 1); the next
    delivery reads the legacy record's params, plans the same run and finishes it."""
    calls = {"n": 0}

    def stop_in_epoch_two() -> str | None:
        calls["n"] += 1
        return "shutdown" if calls["n"] > 3 + 1 else None  # 160 training images at batch 64: 3 steps an epoch

    first = Reporter()
    with pytest.raises(StopJob):
        _trainer(tmp_path, resolve_params(_spec()), first, stop_in_epoch_two).run()
    assert [m.epoch for m in first.epochs] == [1]

    params = TrainingParams.model_validate(LEGACY_PARAMS | {"precision": "fp32"})
    assert params == resolve_params(_spec()).model_copy(update={"schedule": "constant"})
    second = Reporter()
    result = _trainer(tmp_path, params, second, resume_from=first.resume_states[-1]).run()
    assert second.resumed_from == [1] and [m.epoch for m in second.epochs] == [2, 3]
    assert result.final_path.exists() and result.validation is not None


def test_a_job_resumed_on_another_device_type_keeps_the_batch_and_schedule_it_ran(
        clean_redis_url: str, tmp_path: Path) -> None:
    """An "auto" job left its batch open; its first delivery (on a GPU: batch 256, and the default
    schedule, as a run long enough for it records) recorded its choices and a resume state, then its
    worker was lost. The CPU worker that takes it next must go on with the run that state holds, not with
    a CPU's batch of 128 (other steps per epoch, another schedule: the previous code kept both in
    the params it rewrote)."""
    store = JobStore(redis.Redis.from_url(clean_redis_url, decode_responses=True), lambda delivery: None)
    params = resolve_params(_spec(batch_size=None, schedule=None, epochs=3))
    job, _ = store.create(model="cifar_net", dataset="fake", params=params, requested_device="auto")
    on_gpu = DeviceChoices(device="cuda:0", batch_size=256, schedule="cosine", amp_dtype="bfloat16",
                           grad_scaler=False, channels_last=True, cudnn_benchmark=True, data_on_device=True,
                           staging_buffers=0)
    store.redis.hset(keys.job(job.id), "device_choices", on_gpu.model_dump_json())
    redelivered = store.get(job.id)

    plan = plan_training(job.id, "cifar_net", params, small_fake(200), torch.device("cpu"), 3, 32, 32,
                         earlier=redelivered.device_choices)
    assert plan.device.batch_size == 256 and plan.device.schedule == "cosine"  # as the resume state ran
    assert plan.device.device == "cpu" and plan.device.amp_dtype in (None, "bfloat16")  # this device's own
    fresh = plan_training(job.id, "cifar_net", params, small_fake(200), torch.device("cpu"), 3, 32, 32)
    assert fresh.device.batch_size == 128 and fresh.device.schedule == "constant"  # a first delivery decides
