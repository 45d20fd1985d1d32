"""Shape tuning before the first epoch (worker/training/shape_tuning.py), on the CPU twin of a GPU job: it runs
every input shape an epoch will use, and changes nothing the job computes."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from core.kinds.train import JobSpec, resolve_params
from models.cifar_net import CifarNet
from tests.worker.training.test_trainer import Reporter, small_fake
from worker.checkpoints.format import load_payload
from worker.data.datasets import ImageTensors
from worker.runtime.job_context import StopJob
from worker.training.shape_tuning import batch_bounds, epoch_shapes
from worker.training.trainer import Trainer, plan_training

MODEL = "mobilenet_v3_small"  # BatchNorm (running statistics) and Dropout (the global RNG): what tuning could disturb


@pytest.fixture(autouse=True)
def cudnn_benchmark_restored() -> Iterator[None]:
    """A plan with cudnn_benchmark sets torch's process-wide flag (a no-op on the CPU): put it back."""
    before = torch.backends.cudnn.benchmark
    yield
    torch.backends.cudnn.benchmark = before


def run_job(folder: Path, data: ImageTensors, *, tune_shapes: bool, model: str = MODEL, resume_from: Path | None = None,
            should_stop: Callable[[], str | None] = lambda: None, **spec) -> Reporter:
    """A job as a GPU worker plans it (cudnn_benchmark, which turns shape tuning on), on the CPU."""
    params = resolve_params(JobSpec(model=model, dataset="fake", **spec))
    plan = plan_training("job1", model, params, data, torch.device("cpu"), 3, 32, 32).with_choices(cudnn_benchmark=tune_shapes)
    reporter = Reporter()
    Trainer(plan, data, final_path=folder / "model.pt", resume_from=resume_from,
            resume_to=lambda epoch: folder / f"resume-{epoch}.pt", reporter=reporter, should_stop=should_stop).run()
    return reporter


def test_a_job_ends_bit_identical_with_and_without_shape_tuning(tmp_path: Path) -> None:
    data = small_fake(100)  # 80 training images at batch 32: batches of 32, 32 and 16; 20 validation images
    spec = {"epochs": 1, "batch_size": 32, "val_fraction": 0.2, "augment": True, "optimizer": "adamw"}
    plain, tuned = tmp_path / "plain", tmp_path / "tuned"
    reporters = [run_job(plain, data, tune_shapes=False, **spec), run_job(tuned, data, tune_shapes=True, **spec)]

    final = [torch.load(folder / "model.pt", weights_only=True)["state_dict"] for folder in (plain, tuned)]
    assert final[0].keys() == final[1].keys()
    assert any("running_mean" in key for key in final[0])  # BatchNorm statistics are among what is compared
    assert all(torch.equal(final[0][key], final[1][key]) for key in final[0])
    resumes = [load_payload(folder / "resume-1.pt") for folder in (plain, tuned)]
    assert torch.equal(resumes[0]["rng"]["cpu"], resumes[1]["rng"]["cpu"])  # Dropout drew the same numbers
    optimizer_states = [r["optimizer"]["state"] for r in resumes]
    assert optimizer_states[0].keys() == optimizer_states[1].keys()
    for key, state in optimizer_states[0].items():
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(optimizer_states[1][key][k]))
                   for k, v in state.items())
    losses = [[(m.train_loss, m.val_loss) for m in reporter.epochs] for reporter in reporters]
    assert losses[0] == losses[1]


def test_a_resumed_job_tunes_its_shapes_without_touching_its_optimizer_state(tmp_path: Path) -> None:
    """After a resume the optimizer holds state (AdamW's moments): the twin works on a copy of it."""
    data = small_fake(300)
    spec = {"model": "cifar_net", "epochs": 2, "batch_size": 64, "val_fraction": 0.2, "optimizer": "adamw"}
    run_job(tmp_path / "plain", data, tune_shapes=False, **spec)
    after_epoch_one = tmp_path / "cut" / "resume-1.pt"
    with pytest.raises(StopJob):  # stopped at the first step of epoch 2
        run_job(tmp_path / "cut", data, tune_shapes=True, should_stop=lambda: "shutdown" if after_epoch_one.exists() else None,
                **spec)
    resumed = run_job(tmp_path / "cut", data, tune_shapes=True, resume_from=after_epoch_one, **spec)
    assert resumed.resumed_from == [1]
    final = [torch.load(tmp_path / run / "model.pt", weights_only=True)["state_dict"] for run in ("plain", "cut")]
    assert all(torch.equal(final[0][key], final[1][key]) for key in final[0])


def test_shape_tuning_that_runs_out_of_memory_leaves_the_job_as_it_was(tmp_path: Path, gpu_memory_budget: dict,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """The twin needs memory of its own: an out-of-memory error while tuning (raised as the CUDA
    allocator raises it, once) ends the tuning, and the job's back-off does not shrink for it."""
    gpu_memory_budget["transient"] = 1
    with caplog.at_level(logging.WARNING, logger="worker.training.shape_tuning"):
        reporter = run_job(tmp_path, small_fake(200), tune_shapes=True, model="cifar_net", epochs=1, batch_size=64,
                           val_fraction=0.2)
    assert gpu_memory_budget["raised"] == 1
    assert any("no shape tuning: the twin did not fit" in r.getMessage() for r in caplog.records)
    assert [kind for kind, _, _ in reporter.notices] == []  # no batch_backoff
    assert load_payload(tmp_path / "resume-1.pt")["micro_batch"] == 64


def test_shape_tuning_runs_every_shape_an_epoch_uses_and_only_those(tmp_path: Path) -> None:
    """Every forward the model sees, by (training mode, input shape): the tuning's twin goes first
    and sees each shape the epoch then uses, and no other."""
    data = small_fake(700)  # validation 280 = a slice of 256 and one of 24; training 420 = 3 × 128 and 36
    seen: list[tuple[int, bool, tuple[int, ...]]] = []

    def record(module: torch.nn.Module, args: tuple) -> None:
        if isinstance(module, CifarNet):
            seen.append((id(module), module.training, tuple(args[0].shape)))

    handle = torch.nn.modules.module.register_module_forward_pre_hook(record)
    try:
        run_job(tmp_path, data, tune_shapes=True, model="cifar_net", epochs=1, batch_size=128, val_fraction=0.4)
    finally:
        handle.remove()
    twin = seen[0][0]
    tuned = [(training, shape) for module, training, shape in seen if module == twin]
    epoch = [(training, shape) for module, training, shape in seen if module != twin]
    assert seen[:len(tuned)] == [(twin, *call) for call in tuned]  # the tuning ran before the epoch
    assert set(tuned) == set(epoch) == {(True, (128, 3, 32, 32)), (True, (36, 3, 32, 32)),
                                       (False, (256, 3, 32, 32)), (False, (24, 3, 32, 32))}


def test_epoch_shapes_are_the_batches_distinct_sizes() -> None:
    shapes = epoch_shapes((3, 32, 32), batch_bounds(420, 128), 280, 256)
    assert shapes.train_batches == (128, 36) and shapes.val_batches == (256, 24)
    assert epoch_shapes((1, 8, 8), batch_bounds(129, 64), 40, 256).train_batches == (65, 64)  # never a batch of one
    assert epoch_shapes((1, 8, 8), batch_bounds(128, 64), 0, 256).val_batches == ()  # no validation split
