"""The recipe's CUDA-only branches, run through their CPU twins: the precision decision, the
gradient scaler's path, the learning-rate schedule across a resume, the staging buffers'
rotation and reuse, per-image augmentation, the batch back-off driven by an out-of-memory error
raised the way torch raises it, early stopping with the best epoch's weights kept, and starting
weights with a new head."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core.kinds.train import JobSpec, TrainingParams, resolve_params
from models.registry import build_model
from tests.worker.training.test_trainer import Reporter, small_fake
from worker.checkpoints.format import load_payload
from worker.data.datasets import ImageTensors
from worker.device.info import cpu_flags
from worker.runtime.job_context import JobFailed, StopJob
from worker.training import init_weights
from worker.training.augment import random_crop_flip
from worker.training.init_weights import InitialWeights
from worker.training.recipe import NATIVE_BF16_CPU_FLAGS, EarlyStopping, Precision, Score, choose_precision
from worker.training.shape_tuning import batch_bounds
from worker.training.staging import StagedBatches
from worker.training.train_step import micro_batches
from worker.training.trainer import Trainer, plan_training


def trainer(tmp_path: Path, data: ImageTensors, reporter: Reporter, stop=lambda: None, **spec_and_plan) -> Trainer:
    plan_fields = {k: spec_and_plan.pop(k) for k in ("amp_dtype", "grad_scaler") if k in spec_and_plan}
    spec = JobSpec(model="cifar_net", dataset="fake", **{"val_fraction": 0.2, "batch_size": 64, **spec_and_plan})
    plan = plan_training("job1", "cifar_net", resolve_params(spec), data, torch.device("cpu"), 3, 32, 32)
    return Trainer(plan.with_choices(**plan_fields), data, final_path=tmp_path / "model.pt",
                   resume_from=last_resume(tmp_path), resume_to=lambda epoch: tmp_path / f"resume-{epoch}.pt",
                   reporter=reporter, should_stop=stop, dataset="fake")


def last_resume(folder: Path) -> Path | None:
    """The resume state of the last finished epoch in `folder`: what the job store records with that
    epoch's metrics, and what the next delivery resumes from."""
    states = sorted(folder.glob("resume-*.pt"), key=lambda p: int(p.stem.split("-")[1]))
    return states[-1] if states else None


# ---------------------------------------------------------------------------- precision


def test_precision_follows_the_compute_capability_not_bf16_emulation() -> None:
    assert choose_precision("cuda", (9, 0)) == choose_precision("cuda", (8, 0))
    assert choose_precision("cuda", (8, 0)).amp_dtype == "bfloat16" and not choose_precision("cuda", (8, 6)).grad_scaler
    turing = choose_precision("cuda", (7, 5))  # reports bf16 "supported" through emulation
    assert turing.amp_dtype == "float16" and turing.grad_scaler
    assert choose_precision("cuda", (7, 0)).amp_dtype == "float16"
    assert choose_precision("cuda", (6, 1)).amp_dtype is None  # no tensor cores
    assert all(choose_precision("cuda", c).channels_last for c in [(9, 0), (7, 5), (6, 1)])


def test_a_cpu_gets_bf16_where_it_multiplies_bf16_natively() -> None:
    """A CPU's flags decide, as a GPU's capability does: AVX512-BF16 or AMX-BF16 → bf16 autocast in
    channels_last (oneDNN's bf16 kernels' layout); anything else fp32 in NCHW."""
    for flags in [{"avx512f", "avx512_bf16"}, {"amx_bf16", "amx_tile", "avx512_bf16"}]:
        assert choose_precision("cpu", None, flags) == Precision("bfloat16", False, True)
    for flags in [set(), {"avx2", "fma", "avx512f", "avx512_vnni"}, {"neon"}]:
        assert choose_precision("cpu", None, flags) == Precision(None, False, False)
    plan = plan_training("j", "cifar_net", resolve_params(JobSpec(model="cifar_net", dataset="fake")), small_fake(10),
                         torch.device("cpu"), 3, 32, 32)
    native = bool(NATIVE_BF16_CPU_FLAGS & cpu_flags())  # this host's CPU, as /proc/cpuinfo lists it
    assert (plan.device.amp_dtype, plan.device.channels_last) == (("bfloat16", True) if native else (None, False))
    choices = plan.device
    assert not choices.grad_scaler and not choices.cudnn_benchmark and choices.data_on_device
    assert choices.staging_buffers == 0


def test_a_job_may_ask_for_fp32_on_any_device() -> None:
    """`"precision": "fp32"`: no autocast and no scaler anywhere; a GPU keeps channels_last."""
    assert choose_precision("cpu", None, {"avx512_bf16"}, mixed=False) == Precision(None, False, False)
    assert choose_precision("cuda", (9, 0), mixed=False) == Precision(None, False, True)
    assert choose_precision("cuda", (7, 5), mixed=False) == Precision(None, False, True)
    params = resolve_params(JobSpec(model="cifar_net", dataset="fake", precision="fp32"))
    plan = plan_training("j", "cifar_net", params, small_fake(10), torch.device("cpu"), 3, 32, 32)
    choices = plan.device
    assert (params.precision, choices.amp_dtype, choices.grad_scaler, choices.channels_last) == ("fp32", None, False,
                                                                                           False)


def test_fp16_with_the_gradient_scaler_trains_and_resumes_on_cpu(tmp_path: Path) -> None:
    """The Volta/Turing branch (fp16 autocast + GradScaler) on the CPU's own fp16 autocast (slow on
    a CPU, hence small)."""
    data = small_fake(200)  # 160 training images at batch 64: 3 steps an epoch
    calls = {"n": 0}

    def stop_in_epoch_two() -> str | None:
        calls["n"] += 1
        return "shutdown" if calls["n"] > 3 + 1 else None

    first = Reporter()
    with pytest.raises(StopJob):
        trainer(tmp_path, data, first, stop_in_epoch_two, epochs=2, amp_dtype="float16", grad_scaler=True).run()
    saved = load_payload(last_resume(tmp_path))
    assert saved["scaler"]["scale"] > 0 and saved["epoch"] == 1  # the scaler's state is resumable
    second = Reporter()
    result = trainer(tmp_path, data, second, epochs=2, amp_dtype="float16", grad_scaler=True).run()
    assert second.resumed_from == [1] and [m.epoch for m in second.epochs] == [2]
    assert all(m.train_loss == m.train_loss for m in first.epochs + second.epochs)  # finite, not NaN
    assert result.validation is not None and result.validation.num_images == 40


# ---------------------------------------------------------------------------- schedule


@pytest.mark.parametrize("schedule", ["onecycle", "cosine"])
def test_the_schedule_steps_per_step_and_continues_after_a_resume(tmp_path: Path, schedule: str) -> None:
    data = small_fake(400)
    whole = Reporter()
    trainer(tmp_path / "whole", data, whole, epochs=4, schedule=schedule, patience=0).run()
    rates = [m.learning_rate for m in whole.epochs]
    peak = resolve_params(JobSpec(model="cifar_net", dataset="fake")).learning_rate
    assert peak * 0.5 <= rates[0] <= peak and rates[-1] < 0.1 * peak  # warmed up to the peak, then annealed
    assert rates == sorted(rates, reverse=True)

    calls = {"n": 0}

    def stop_in_epoch_three() -> str | None:
        calls["n"] += 1
        return "shutdown" if calls["n"] > 10 + 2 else None

    with pytest.raises(StopJob):
        trainer(tmp_path / "cut", data, Reporter(), stop_in_epoch_three, epochs=4, schedule=schedule, patience=0).run()
    resumed = Reporter()
    trainer(tmp_path / "cut", data, resumed, epochs=4, schedule=schedule, patience=0).run()
    assert [m.epoch for m in resumed.epochs] == [3, 4]
    assert [m.learning_rate for m in resumed.epochs] == pytest.approx(rates[2:])  # not restarted from warm-up


# ---------------------------------------------------------------------------- staging buffers


def test_staging_buffers_rotate_and_are_reused() -> None:
    images = torch.arange(10 * 3 * 4 * 4, dtype=torch.uint8).view(10, 3, 4, 4)
    labels = torch.arange(10)
    staged = StagedBatches(images, labels, torch.device("cpu"), capacity=4, buffers=3)
    pointers = [b.data_ptr() for b, _ in staged.buffers]
    order = torch.randperm(10, generator=torch.Generator().manual_seed(0))
    slots, batches = [], []
    for begin in range(0, 10, 4):  # 4, 4, 2: the last batch uses the front of its buffer
        index = order[begin:begin + 4]
        x, y = staged.take(index)
        slots.append(staged.slot)
        batches.append((index, x, y))
    x, y = staged.slice(6, 10)
    slots.append(staged.slot)
    assert slots == [0, 1, 2, 0]
    assert [b.data_ptr() for b, _ in staged.buffers] == pointers  # allocated once, never again
    for index, x, y in batches:  # what came out is the batch asked for, and owns its memory
        assert torch.equal(x, images[index]) and torch.equal(y, labels[index])
        assert x.data_ptr() not in pointers
    assert torch.equal(batches[0][1], images[order[:4]])  # still intact after its buffer was reused
    with pytest.raises(ValueError):
        staged.take(torch.arange(5))


# ---------------------------------------------------------------------------- augmentation


def test_each_image_gets_its_own_crop_and_flip() -> None:
    image = torch.arange(16 * 16, dtype=torch.float32).view(1, 1, 16, 16)
    batch = image.repeat(64, 3, 1, 1)
    out = random_crop_flip(batch, torch.Generator().manual_seed(0))
    assert out.shape == batch.shape and out.dtype == batch.dtype
    distinct = {tuple(o[0].flatten().tolist()) for o in out}
    assert len(distinct) > 20  # drawn per image, not one offset for the batch
    flipped = sum(bool(o[0, 8, 8] < o[0, 8, 7]) for o in out)  # mid-row, where no border reflection reaches
    assert 10 < flipped < 54
    assert set(out.unique().tolist()) <= set(image.unique().tolist())  # pixels of the image (reflected border)
    again = random_crop_flip(batch, torch.Generator().manual_seed(0))
    assert torch.equal(out, again)
    uint8 = random_crop_flip(batch.to(torch.uint8), torch.Generator().manual_seed(0))
    assert uint8.dtype == torch.uint8


# ---------------------------------------------------------------------------- out-of-memory back-off


def test_out_of_memory_halves_the_passes_and_keeps_the_steps(tmp_path: Path, gpu_memory_budget: dict) -> None:
    gpu_memory_budget["images"] = 16
    reporter = Reporter()
    result = trainer(tmp_path, small_fake(400), reporter, epochs=2).run()
    assert [m.epoch for m in reporter.epochs] == [1, 2]
    backoffs = [(data["was"], data["micro_batch"]) for kind, data, _ in reporter.notices if kind == "batch_backoff"]
    assert backoffs == [(64, 32), (32, 16)]  # once each, then it stays at 16
    assert all(p.steps == 5 for p in reporter.progress_events)  # the batch (and schedule) stays 64
    assert "retrying with 16" in reporter.notices[-1][2]
    assert load_payload(last_resume(tmp_path))["micro_batch"] == 16
    assert result.validation is not None and result.validation.accuracy >= 0.5  # learning, well above chance


def test_a_passing_out_of_memory_at_the_floor_is_retried(tmp_path: Path, gpu_memory_budget: dict) -> None:
    gpu_memory_budget["transient"] = 2
    reporter = Reporter()
    trainer(tmp_path, small_fake(100), reporter, epochs=1, batch_size=8).run()  # 8 = the floor
    notices = [message for kind, _, message in reporter.notices if kind == "batch_backoff"]
    assert len(notices) == 2 and "retry 1/3" in notices[0] and "retry 2/3" in notices[1]
    assert [m.epoch for m in reporter.epochs] == [1]


def test_out_of_memory_that_never_passes_fails_the_job(tmp_path: Path, gpu_memory_budget: dict) -> None:
    gpu_memory_budget["images"] = 4
    with pytest.raises(JobFailed, match="even at 8 images per pass after 3 retries"):
        trainer(tmp_path, small_fake(100), Reporter(), epochs=1, batch_size=16).run()


# ---------------------------------------------------------------------------- best epoch, early stopping


def test_early_stopping_judges_by_the_monitor() -> None:
    by_accuracy = EarlyStopping("val_accuracy", patience=2)
    assert by_accuracy.update(1, Score(0.5, 1.0)) and by_accuracy.update(2, Score(0.5, 0.9))  # tie: lower loss
    assert not by_accuracy.should_stop  # the tie's weights are kept, but it counts as no improvement
    assert by_accuracy.update(3, Score(0.6, 0.95)) and by_accuracy.epochs_without_improvement == 0
    assert not by_accuracy.update(4, Score(0.4, 0.5)) and not by_accuracy.should_stop
    assert not by_accuracy.update(5, Score(0.6, 0.97)) and by_accuracy.should_stop
    assert by_accuracy.best_epoch == 3 and "did not improve for 2 epochs" in by_accuracy.reason()
    by_loss = EarlyStopping("val_loss", patience=0)
    assert by_loss.update(1, Score(0.1, 1.0)) and by_loss.update(2, Score(0.0, 0.5))
    assert not by_loss.update(3, Score(0.9, 0.6)) and not by_loss.should_stop  # 0: never stops


def test_a_saturated_accuracy_stops_by_patience_while_the_tie_break_still_picks_the_weights() -> None:
    """Validation accuracy at 1.0 while val_loss keeps falling (a net that grows more confident): the
    lower loss picks the kept epoch, but only a higher accuracy resets patience, so the run stops."""
    stopper = EarlyStopping("val_accuracy", patience=5)
    assert stopper.update(1, Score(0.9, 0.5)) and stopper.update(2, Score(1.0, 0.1))
    stopped_at = None
    for epoch in range(3, 40):
        assert stopper.update(epoch, Score(1.0, 0.1 / epoch))  # each epoch's weights are the new best
        if stopper.should_stop:
            stopped_at = epoch
            break
    assert stopped_at == 7 and stopper.best_epoch == 7 and stopper.best == Score(1.0, 0.1 / 7)
    assert stopper.reason() == ("early stopping: val_accuracy did not improve for 5 epochs (patience 5); "
                                "best 1.0000 at epoch 7")
    by_loss = EarlyStopping("val_loss", patience=2)  # the loss is the monitor: every lower loss improves
    for epoch in range(1, 10):
        by_loss.update(epoch, Score(1.0, 1.0 / epoch))
    assert not by_loss.should_stop and by_loss.best_epoch == 9


def test_early_stopping_keeps_the_best_epochs_weights(tmp_path: Path) -> None:
    """Random labels: the validation loss only gets worse once the net memorises the training split."""
    data = small_fake(400)
    noisy = ImageTensors(data.images, data.labels[torch.randperm(400, generator=torch.Generator().manual_seed(1))],
                         data.classes)
    reporter = Reporter()
    result = trainer(tmp_path, noisy, reporter, epochs=30, patience=2, monitor="val_loss", learning_rate=0.01,
                     schedule="constant").run()
    ran = [m.epoch for m in reporter.epochs]
    assert len(ran) < 30 and result.stop_reason.startswith("early stopping: val_loss did not improve for 2 epochs")
    assert result.best_epoch == ran[-3]
    losses = {m.epoch: m.val_loss for m in reporter.epochs}
    assert losses[result.best_epoch] == min(losses.values())
    assert [kind for kind, _, _ in reporter.notices] == ["early_stop"]
    assert reporter.epochs[-1].confusion_matrix is not None  # the final epoch's, only
    assert all(m.confusion_matrix is None for m in reporter.epochs[:-1])
    kept = torch.load(tmp_path / "model.pt", weights_only=True)
    best = load_payload(last_resume(tmp_path))["best"]
    assert best["epoch"] == result.best_epoch
    assert all(torch.equal(kept["state_dict"][k], v) for k, v in best["state_dict"].items())
    assert kept["meta"]["training"]["best_epoch"] == result.best_epoch
    assert result.validation is not None and result.validation.epoch == result.best_epoch
    assert result.validation.loss == losses[result.best_epoch]
    matrix = result.validation.confusion_matrix
    assert matrix is not None and sum(map(sum, matrix)) == result.validation.num_images == 80


# ---------------------------------------------------------------------------- batches and starting weights


def test_batches_never_leave_a_single_image() -> None:
    assert batch_bounds(450, 32)[-1] == (448, 450)
    assert batch_bounds(65, 64) == [(0, 65)] and batch_bounds(129, 64) == [(0, 64), (64, 129)]
    assert batch_bounds(1, 64) == [(0, 1)]
    assert list(micro_batches(33, 16)) == [(0, 11), (11, 22), (22, 33)]
    assert list(micro_batches(64, 64)) == [(0, 64)]


def test_starting_weights_keep_reorder_or_reinitialise_the_head() -> None:
    torch.manual_seed(0)
    parent = build_model("cifar_net", 3)
    initial = InitialWeights(parent.state_dict(), ["a", "b", "c"], (0.5,) * 3, (0.25,) * 3, None, {"init_from": "p"})

    same = build_model("cifar_net", 3)
    assert init_weights.apply(same, "cifar_net", initial, ["a", "b", "c"]) == "kept"
    assert all(torch.equal(v, parent.state_dict()[k]) for k, v in same.state_dict().items())

    reordered = build_model("cifar_net", 3)
    assert init_weights.apply(reordered, "cifar_net", initial, ["c", "a", "b"]) == "reordered"
    assert torch.equal(reordered.fc3.weight[0], parent.fc3.weight[2])
    assert torch.equal(reordered.conv1.weight, parent.conv1.weight)

    other = build_model("cifar_net", 5)
    fresh_head = other.fc3.weight.detach().clone()
    assert init_weights.apply(other, "cifar_net", initial, ["v", "w", "x", "y", "z"]) == "reinitialised"
    assert torch.equal(other.fc1.weight, parent.fc1.weight) and torch.equal(other.conv2.weight, parent.conv2.weight)
    assert torch.equal(other.fc3.weight, fresh_head) and other.fc3.weight.shape == (5, 84)

    with pytest.raises(JobFailed, match="do not fit"):
        init_weights.apply(build_model("catdog_net", 3), "catdog_net", initial, ["a", "b", "c"])


def test_params_stored_before_the_recipe_read_back_as_they_ran() -> None:
    old = {"epochs": 3, "batch_size": None, "learning_rate": 0.001, "optimizer": "adamw", "seed": 0,
           "val_fraction": 0.1, "image_size": 32, "augment": False, "pinned_memory": False}
    params = TrainingParams.model_validate(old)
    assert (params.schedule, params.label_smoothing, params.patience, params.keep) == ("constant", 0.0, 0, "last")
    assert params.weight_decay == 0.01  # AdamW's torch default, which the old trainer used
    assert TrainingParams.model_validate({**old, "optimizer": "adam"}).weight_decay == 0.0
    fresh = resolve_params(JobSpec(model="cifar_net", dataset="fake"))
    assert (fresh.schedule, fresh.keep, fresh.optimizer, fresh.min_schedule_steps) == ("cosine", "best", "adamw", 200)
    asked = resolve_params(JobSpec(model="cifar_net", dataset="fake", schedule="onecycle"))
    assert asked.min_schedule_steps == 0 and asked.warmup_fraction == 0.25


def test_the_default_schedule_needs_room_and_a_named_one_always_applies() -> None:
    data = small_fake(2560)  # 2,048 training images at batch 64: 32 steps an epoch
    def plan(epochs: int, **spec) -> str:
        params = resolve_params(JobSpec(model="cifar_net", dataset="fake", epochs=epochs, batch_size=64,
                                        val_fraction=0.2, **spec))
        return plan_training("j", "cifar_net", params, data, torch.device("cpu"), 3, 32, 32).device.schedule
    assert plan(6) == "constant" and plan(7) == "cosine"  # 192 steps < 200 <= 224
    assert plan(1, schedule="cosine") == "cosine"
