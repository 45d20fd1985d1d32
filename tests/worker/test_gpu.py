"""What only a GPU runs, on a GPU (`pytest -m gpu`; skipped where torch sees no CUDA, as on CI):
the fp16 GradScaler's state across a resume, the serving graph traced (not fallen back to eager)
on CUDA, and the pinned staging ring (worker/device/pinned_ring.py) whose CUDA events guard a buffer
while its copy is in flight: training's, alone and in a training run, and serving's. Every CUDA call here is listed in docs/gpu.md with what it
does; the CPU twins of the same code run in the default suite."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from core.kinds.train import JobSpec, resolve_params
from models.registry import MODELS, build_model
from tests.worker.checkpoints.test_forward_graph import _preprocessing
from tests.worker.training.test_trainer import Reporter, small_fake
from worker.checkpoints.format import load_payload
from worker.checkpoints.forward_graph import GRAPH_TOLERANCE, ServingForward, build_forward
from worker.runtime.job_context import StopJob
from worker.serving.batching import HostStaging
from worker.training.staging import StagedBatches
from worker.training.trainer import Trainer, plan_training

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


def _trainer(tmp_path: Path, epochs: int, reporter: Reporter, stop=lambda: None, resume_from: Path | None = None):
    data = small_fake(320)
    params = resolve_params(JobSpec(model="cifar_net", dataset="fake", epochs=epochs, val_fraction=0.2, batch_size=64))
    plan = plan_training("gpu1", "cifar_net", params, data, CUDA, 3, 32, 32)
    # fp16 with a GradScaler, what a compute capability 7.x GPU gets, on whatever GPU runs the test
    plan = plan.with_choices(amp_dtype="float16", grad_scaler=True)
    return Trainer(plan, data, final_path=tmp_path / "model.pt", resume_from=resume_from,
                   resume_to=lambda epoch: tmp_path / f"resume-{epoch}.pt", reporter=reporter, should_stop=stop)


def test_the_fp16_grad_scaler_state_survives_a_resume(tmp_path: Path) -> None:
    """Stopped in epoch 2 (what a SIGTERM or a lost worker does), resumed by a fresh Trainer: the
    scaler goes on from the state the resume file holds. A scale no fresh GradScaler can have
    (3000: a fresh one starts at 2**16 and only halves or doubles) is written into the file; the
    resumed run's scale must be 3000 halved k >= 0 times (once per step that overflowed)."""
    calls = {"n": 0}

    def stop_in_epoch_two() -> str | None:
        calls["n"] += 1
        return "shutdown" if calls["n"] > 4 + 2 else None  # 256 training images / batch 64: 4 steps an epoch

    first = Reporter()
    with pytest.raises(StopJob):
        _trainer(tmp_path, 3, first, stop_in_epoch_two).run()
    assert [m.epoch for m in first.epochs] == [1]
    state = load_payload(tmp_path / "resume-1.pt")
    assert state["scaler"] and state["scaler"]["scale"] > 0, state.get("scaler")
    state["scaler"]["scale"] = 3000.0
    torch.save(state, tmp_path / "resume-1.pt")

    second = Reporter()
    _trainer(tmp_path, 3, second, resume_from=tmp_path / "resume-1.pt").run()
    assert second.resumed_from == [1] and [m.epoch for m in second.epochs] == [2, 3]
    scale = load_payload(tmp_path / "resume-3.pt")["scaler"]["scale"]
    halvings = math.log2(3000.0 / scale)
    assert halvings >= 0 and halvings == int(halvings), f"scale {scale} does not descend from the resumed 3000"
    assert all(math.isfinite(m.train_loss) for m in second.epochs)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_architecture_is_served_traced_on_the_gpu(name: str) -> None:
    """On CUDA, under the cuDNN setting the inference thread uses (benchmark), the traced graph
    agrees with the eager module within GRAPH_TOLERANCE and is what serves: a GPU model that fell
    back to eager would hold the GIL at every operator. Serving runs in float32 (no autocast: the
    checkpoint's float32 weights), so the comparison is float32 against float32, the same kernels
    for the same shapes; bf16/fp16 never enter it (their rounding, ~1e-3, would not fit 1e-5)."""
    torch.manual_seed(0)
    pre = _preprocessing(name)
    network = build_model(name, 7, pre.channels).eval().to(CUDA)
    benchmark = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        graph = build_forward(network, pre, CUDA)
        assert graph.kind == "torchscript", f"{name} fell back to eager on the GPU (the worker's log says why)"
        eager = ServingForward(network, pre.mean, pre.std).to(CUDA).eval()
        with torch.inference_mode(), torch.jit.optimized_execution(False):
            for batch in (1, 8):
                images = torch.randint(0, 256, (batch, pre.channels, pre.height, pre.width), dtype=torch.uint8,
                                       device=CUDA)
                difference = (graph.run(images) - eager(images)).abs().max().item()
                assert difference <= GRAPH_TOLERANCE, (name, batch, difference)
    finally:
        torch.backends.cudnn.benchmark = benchmark


def test_pinned_staging_buffers_are_not_overwritten_while_their_copy_is_in_flight() -> None:
    """Two pinned buffers, six batches, and the stream kept busy before each copy (torch.cuda._sleep,
    the spin kernel of PyTorch's own stream tests), so each asynchronous copy is still queued when
    the host wants its buffer again two batches later: the buffer's event must hold the host back,
    or the earlier batch would reach the GPU with the later one's images."""
    images = torch.randint(0, 256, (96, 3, 32, 32), dtype=torch.uint8)
    labels = torch.arange(96)
    staged = StagedBatches(images, labels, CUDA, capacity=16, buffers=2)
    assert staged.ring.behind
    assert all(image.is_pinned() and label.is_pinned() for image, label in staged.buffers)
    taken = []
    for _ in range(6):
        torch.cuda._sleep(20_000_000)  # some milliseconds of GPU spin, queued before the copy
        index = torch.randperm(96)[:16]
        taken.append((index, *staged.take(index)))
        assert isinstance(staged.ring.copied[staged.slot], torch.cuda.Event)
    torch.cuda.synchronize()
    for index, x, y in taken:
        assert x.device.type == "cuda" and torch.equal(x.cpu(), images[index]) and torch.equal(y.cpu(), labels[index])


def test_serving_staging_uses_the_same_guarded_ring_on_a_gpu() -> None:
    """/predict's HostStaging through the same ring: two pinned buffers per shape, six batches, the
    stream kept busy before each copy as above; every batch reaches the GPU as it was stacked, its
    padded rows zero, though its buffer was written again two batches later."""
    staging = HostStaging(CUDA, capacity=8)
    sent = []
    for k in range(6):
        torch.cuda._sleep(20_000_000)
        arrays = [np.full((3, 4, 4), 10 * k + i, dtype=np.uint8) for i in range(1 + k % 3)]
        sent.append((arrays, staging.upload(arrays, rows=4)))
        ring = staging.rings[("|u1", (3, 4, 4))]
        assert ring.behind and isinstance(ring.copied[ring.slot], torch.cuda.Event)
    assert all(buffer.is_pinned() for buffer in staging.rings[("|u1", (3, 4, 4))].slots)
    torch.cuda.synchronize()
    for arrays, batch in sent:
        expected = torch.zeros((4, 3, 4, 4), dtype=torch.uint8)
        expected[:len(arrays)] = torch.from_numpy(np.stack(arrays))
        assert batch.device.type == "cuda" and torch.equal(batch.cpu(), expected)


def test_a_job_trains_through_the_pinned_staging_buffers(tmp_path: Path) -> None:
    """The path of a split too big for the GPU, forced on a small one: every batch gathered into a
    pinned buffer and copied asynchronously, guarded by its event; the job learns as it does with
    the split resident (the `fake` set's patterns: well above chance after two epochs)."""
    data = small_fake(640)
    params = resolve_params(JobSpec(model="cifar_net", dataset="fake", epochs=2, val_fraction=0.2, batch_size=64))
    plan = plan_training("gpu2", "cifar_net", params, data, CUDA, 3, 32, 32).with_choices(data_on_device=False,
                                                                                          staging_buffers=3)
    reporter = Reporter()
    Trainer(plan, data, final_path=tmp_path / "model.pt", resume_from=None,
            resume_to=lambda epoch: tmp_path / f"resume-{epoch}.pt", reporter=reporter, should_stop=lambda: None).run()
    assert [m.epoch for m in reporter.epochs] == [1, 2]
    assert reporter.epochs[-1].val_accuracy > 0.5, reporter.epochs[-1]
