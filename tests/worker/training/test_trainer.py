"""The training loop on the CPU: metrics per epoch, resume after the last finished epoch, stops."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core.kinds.train import JobSpec, resolve_params
from core.schemas import EpochMetrics, Progress
from worker.checkpoints.format import load_payload
from worker.data.datasets import ImageTensors, load_fake
from worker.runtime.job_context import StopJob
from worker.training.trainer import Trainer, plan_training


class Reporter:
    def __init__(self) -> None:
        self.epochs: list[EpochMetrics] = []
        self.progress_events: list[Progress] = []
        self.resumed_from: list[int] = []
        self.resume_states: list[Path | None] = []
        self.notices: list[tuple[str, dict, str]] = []

    def progress(self, progress: Progress) -> None:
        self.progress_events.append(progress)

    def epoch(self, metrics: EpochMetrics, resume: Path | None = None) -> None:
        self.epochs.append(metrics)
        self.resume_states.append(resume)

    def resumed(self, epoch: int) -> None:
        self.resumed_from.append(epoch)

    def notice(self, kind: str, data: dict, message: str) -> None:
        self.notices.append((kind, data, message))


def small_fake(n: int = 400) -> ImageTensors:
    data = load_fake(3, 32, 32, seed=0)
    return ImageTensors(data.images[:n], data.labels[:n], data.classes)


def make_trainer(tmp_path: Path, data: ImageTensors, epochs: int, reporter: Reporter, stop=lambda: None,
                 resume_from: Path | None = None, augment: bool = False, **choices) -> Trainer:
    params = resolve_params(JobSpec(model="cifar_net", dataset="fake", epochs=epochs, val_fraction=0.2,
                                    batch_size=64, augment=augment))
    plan = plan_training("job1", "cifar_net", params, data, torch.device("cpu"), 3, 32, 32).with_choices(**choices)
    return Trainer(plan, data, final_path=tmp_path / "model.pt", resume_from=resume_from,
                   resume_to=lambda epoch: tmp_path / f"resume-{epoch}.pt", reporter=reporter, should_stop=stop)


def test_trains_and_records_preprocessing(tmp_path: Path) -> None:
    reporter = Reporter()
    result = make_trainer(tmp_path, small_fake(), 3, reporter).run()
    assert [m.epoch for m in reporter.epochs] == [1, 2, 3] and reporter.resumed_from == []
    assert reporter.epochs[-1].val_accuracy >= 0.85  # learning (chance is 0.1); bf16 lands an image from fp32
    assert reporter.epochs[-1].images_per_second > 0 and set(reporter.epochs[-1].per_class_accuracy) <= set(result.meta.classes)
    payload = torch.load(tmp_path / "model.pt", map_location="cpu", weights_only=True)
    pre = payload["meta"]["preprocessing"]
    assert pre["channels"] == 3 and (pre["height"], pre["width"]) == (32, 32)
    assert len(pre["mean"]) == 3 and all(0 < s < 1 for s in pre["std"])


def test_channels_last_and_augment_on_cpu(tmp_path: Path) -> None:
    """The CUDA path's memory format and the on-device augmentation, exercised where we can run
    them: train and evaluate."""
    reporter = Reporter()
    make_trainer(tmp_path, small_fake(200), 1, reporter, channels_last=True, augment=True).run()
    assert reporter.epochs[0].val_accuracy is not None


def test_resume_continues_after_the_last_finished_epoch(tmp_path: Path) -> None:
    data = small_fake()
    first = Reporter()
    calls = {"n": 0}
    steps_per_epoch = 5  # 320 training images / batch 64

    def stop_in_epoch_three() -> str | None:
        calls["n"] += 1
        return "shutdown" if calls["n"] > 2 * steps_per_epoch + 2 else None

    with pytest.raises(StopJob) as info:
        make_trainer(tmp_path, data, 4, first, stop_in_epoch_three).run()
    assert info.value.reason == "shutdown"
    assert [m.epoch for m in first.epochs] == [1, 2]
    # Each epoch's resume state is a file of its own, handed over with that epoch's metrics.
    assert first.resume_states == [tmp_path / "resume-1.pt", tmp_path / "resume-2.pt"]
    assert load_payload(tmp_path / "resume-2.pt", map_location="cpu")["epoch"] == 2

    second = Reporter()
    make_trainer(tmp_path, data, 4, second, resume_from=first.resume_states[-1]).run()
    assert second.resumed_from == [2]
    assert [m.epoch for m in second.epochs] == [3, 4]  # never from zero


def test_stop_before_the_first_step(tmp_path: Path) -> None:
    reporter = Reporter()
    with pytest.raises(StopJob):
        make_trainer(tmp_path, small_fake(100), 2, reporter, lambda: "cancelled").run()
    assert reporter.epochs == [] and not (tmp_path / "model.pt").exists()


def test_a_train_split_of_one_image_trains(tmp_path: Path) -> None:
    """Two images at val_fraction 0.5 leave one to train on: a network with BatchNorm (resnet18)
    cannot normalise a batch of one in training mode (its variance divides by n - 1), so the
    trainer gives it that image twice; its metrics count the image once."""
    data = small_fake(2)
    params = resolve_params(JobSpec(model="resnet18", dataset="fake", epochs=2, val_fraction=0.5))
    plan = plan_training("job1", "resnet18", params, data, torch.device("cpu"), 3, 32, 32)
    reporter = Reporter()
    Trainer(plan, data, final_path=tmp_path / "model.pt", resume_from=None,
            resume_to=lambda epoch: tmp_path / f"resume-{epoch}.pt", reporter=reporter, should_stop=lambda: None).run()
    assert [m.epoch for m in reporter.epochs] == [1, 2]
    assert all(m.train_accuracy in (0.0, 1.0) for m in reporter.epochs)
    assert (tmp_path / "model.pt").exists()
