"""An export job: a trained job's model as a file that runs without torchyard, checked before it is served.

The file holds the network behind its normalisation (`ClassifierWithPreprocessing`): it takes a
float32 N×C×H×W batch in [0, 1] at the trained size (the batch dimension is dynamic) and returns
logits, so a user's code resizes, converts to RGB or L and scales by 1/255, and nothing else
(docs/deploying-models.md). The class names and the input spec travel inside it (`MANIFEST`):
TorchScript's `_extra_files["torchyard.json"]`, ONNX's `metadata_props` ("torchyard", "classes").

Formats: TorchScript by `torch.jit.trace` (the networks have no data-dependent control flow);
ONNX by the TorchDynamo-based `torch.onnx.export(..., dynamo=True)` at opset ONNX_OPSET, the
exporter PyTorch keeps (the TorchScript-based one warns that it will be removed), on torch 2.6 and
later. Both run on the CPU, whatever the worker's device: the file is for other hosts.

Parity: before the job succeeds, the written file is loaded back (torch.jit.load, or an
onnxruntime session) and run on a batch of real inputs (images of the job's own dataset, through
the same transform as training and /predict, only the PARITY_INPUTS checked decoded, whatever the
dataset's size; synthetic ones only when the dataset is gone) and on
a batch of one; its probabilities must match the checkpoint's within PARITY_TOLERANCE, else the
job fails with the measured difference. A worker that dies mid-export is retried like any job:
the file is written atomically under the export job's own directory.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn

from core.config import Settings
from core.datasets import FAKE_CLASSES, FAKE_IMAGES, DatasetRecord
from core.defaults import EXPORT_PARITY_IMAGES
from core.errors import NotFound
from core.images import IMAGE_FORMATS
from core.kinds.export.params import ExportParams
from core.kinds.export.submit import UNAVAILABLE_PREFIX, export_path
from core.schemas import CheckpointInfo, ExportFormat, Job, Progress
from core.storage import atomic_path, sha256_file
from worker.checkpoints import thread_warnings
from worker.checkpoints.format import ModelMeta, load_model
from worker.checkpoints.forward_graph import ClassifierWithPreprocessing
from worker.data.datasets import DatasetUnavailable, fake_images, open_torchvision
from worker.data.image_array import image_to_array
from worker.runtime.job_context import JobContext, JobFailed, JobOutcome, StopJob

log = logging.getLogger(__name__)

MANIFEST_FORMAT = "torchyard.export/1"
ONNX_OPSET = 18
PARITY_TOLERANCE = 1e-4
PARITY_INPUTS = EXPORT_PARITY_IMAGES  # images of the dataset (core/defaults.py), plus a few uniform-noise ones
INPUT_NAME, OUTPUT_NAME = "input", "logits"
_STEPS = 4  # load, build, write, check


def run_export_job(job: Job, ctx: JobContext) -> JobOutcome:
    params = ExportParams.of(job)
    fmt = params.format
    if fmt is ExportFormat.onnx:
        _require_onnx(ctx)
    progress = _Progress(ctx)
    checkpoint = ctx.paths.final(params.source_job_id)
    if not checkpoint.exists():
        raise JobFailed(f"job {params.source_job_id} has no checkpoint on this worker's storage (its files were "
                        f"deleted, or the worker does not share the API's data dir)")
    if sha256_file(checkpoint) != params.checkpoint_sha256:
        raise JobFailed(f"the checkpoint of job {params.source_job_id} on this worker's storage is not the one "
                        f"recorded (sha256 {params.checkpoint_sha256[:12]}…); export it again")
    network, meta = load_model(checkpoint, "cpu")  # weights_only=True
    model = ClassifierWithPreprocessing(network, meta.preprocessing.mean, meta.preprocessing.std).eval()
    inputs, inputs_from = _parity_inputs(job, meta, ctx)
    progress.step(1)
    manifest = _manifest(job, params, meta)
    # Written under this delivery's own directory; promoted to export_path(...) only if this
    # delivery finishes the job succeeded (worker/runtime/job_context.py), so a stale one changes nothing.
    target = ctx.output_path(export_path(ctx.paths, job.id, fmt).name)
    with atomic_path(target) as tmp:
        example = inputs[:2]
        if fmt is ExportFormat.torchscript:
            _write_torchscript(model, example, tmp, manifest)
            progress.step(2)
            run = _torchscript_runner(tmp)
        else:
            _write_onnx(model, example, tmp, manifest)
            progress.step(2)
            run = _onnx_runner(tmp)
        difference = _parity(model, run, inputs)
        progress.step(3)
        record = {"max_abs_probability_difference": difference, "tolerance": PARITY_TOLERANCE,
                  "inputs": len(inputs), "inputs_from": inputs_from}
        ctx.set_params({**job.params, "parity": record})
        if not difference <= PARITY_TOLERANCE:  # NaN fails too
            raise JobFailed(f"parity check failed: the {fmt.value} export and the checkpoint differ by up to "
                            f"{difference:.3g} in probability on {len(inputs)} inputs ({inputs_from}); the "
                            f"tolerance is {PARITY_TOLERANCE:g}")
    progress.step(4)
    log.info("job %s: exported job %s as %s (%d bytes), parity %.2g on %d inputs", job.id, params.source_job_id,
             fmt.value, target.stat().st_size, difference, len(inputs))
    return JobOutcome(checkpoint=CheckpointInfo(url=f"/jobs/{params.source_job_id}/export?format={fmt.value}",
                                                sha256=sha256_file(target), bytes=target.stat().st_size))


# ---------------------------------------------------------------------- what travels with the file
def _manifest(job: Job, params: ExportParams, meta: ModelMeta) -> dict[str, Any]:
    pre = meta.preprocessing
    manifest: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "job_id": params.source_job_id,
        "export_job_id": job.id,
        "architecture": meta.architecture,
        "classes": meta.classes,
        "input": {"name": INPUT_NAME, "dtype": "float32", "layout": "NCHW", "shape": [None, pre.channels, pre.height,
                                                                                      pre.width],
                  "range": [0.0, 1.0], "color": "L" if pre.channels == 1 else "RGB",
                  "resize": {"width": pre.width, "height": pre.height, "resample": "bilinear",
                             # pretrained weights' transform: shorter side to this, then a centre crop
                             "shorter_side": pre.resize_size, "center_crop": pre.resize_size is not None}},
        "output": {"name": OUTPUT_NAME, "shape": [None, meta.num_classes], "kind": "logits (softmax not applied)"},
        "normalization": {"mean": list(pre.mean), "std": list(pre.std), "inside_the_graph": True},
        "preprocessing": pre.transform.replace("→ (x - mean[c]) / std[c] per channel", "(mean/std: inside the graph)"),
        "checkpoint_sha256": params.checkpoint_sha256,
        "torch_version": str(torch.__version__),
        "parity_tolerance": PARITY_TOLERANCE,
    }
    if params.format is ExportFormat.onnx:
        manifest["onnx_opset"] = ONNX_OPSET
    return manifest


# ---------------------------------------------------------------------- formats
def _write_torchscript(model: nn.Module, example: torch.Tensor, path: Path, manifest: dict[str, Any]) -> list[str]:
    """Trace and save; the tracer's warnings of this thread, logged (the export's own parity check
    on real images judges the file; a serving graph that warns is refused: worker/checkpoints/forward_graph.py).
    Caught per thread (worker/checkpoints/thread_warnings.py), never by changing the process's filters, which a
    serving trace on another thread relies on at the same moment. torch.jit's own deprecation
    notices are ignored there: TorchScript is still what libtorch, TorchServe and `torch.jit.load` run."""
    with thread_warnings.caught() as found:
        with torch.no_grad():
            traced = torch.jit.trace(model, example, check_trace=False)
        torch.jit.save(traced, str(path), _extra_files={"torchyard.json": json.dumps(manifest)})
    warned = thread_warnings.tracer_warnings(found)
    for text in warned:
        log.warning("export trace: %s", text)
    return warned


def _torchscript_runner(path: Path) -> Callable[[np.ndarray], np.ndarray]:
    with thread_warnings.caught():
        loaded = torch.jit.load(str(path), map_location="cpu")
    loaded.eval()

    def run(batch: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return loaded(torch.from_numpy(batch)).numpy()

    return run


def _require_onnx(ctx: JobContext) -> None:
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401  (the dynamo exporter translates to ONNX through it)
    except ImportError as exc:
        raise JobFailed(f"{UNAVAILABLE_PREFIX}{exc.name or 'onnx'} is not installed on worker "
                        f"{ctx.device.worker_name}; install the export extra (pip install 'torchyard[export]')") from exc


def _write_onnx(model: nn.Module, example: torch.Tensor, path: Path, manifest: dict[str, Any]) -> None:
    import onnx

    batch = torch.export.Dim("batch", min=1, max=65536)
    with thread_warnings.caught() as found:  # the exporter's chatter, this thread's only, dropped
        torch.onnx.export(model, (example,), str(path), dynamo=True, opset_version=ONNX_OPSET,
                          input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
                          dynamic_shapes={"x": {0: batch}}, external_data=False, verbose=False)
    log.debug("onnx export: %d warnings dropped", len(found))
    proto = onnx.load(str(path))
    onnx.helper.set_model_props(proto, {"torchyard": json.dumps(manifest), "classes": json.dumps(manifest["classes"])})
    onnx.checker.check_model(proto)
    onnx.save(proto, str(path))


def _onnx_runner(path: Path) -> Callable[[np.ndarray], np.ndarray]:
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1  # a check, not a benchmark: leave the cores to inference and training
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def run(batch: np.ndarray) -> np.ndarray:
        return session.run([OUTPUT_NAME], {INPUT_NAME: batch})[0]

    return run


# ---------------------------------------------------------------------- parity
def _parity_inputs(job: Job, meta: ModelMeta, ctx: JobContext) -> tuple[torch.Tensor, str]:
    """Float32 N×C×H×W in [0, 1]: up to PARITY_INPUTS images of the job's dataset (as training saw
    them), plus noise. Only the images checked are decoded (`_dataset_samples`)."""
    pre = meta.preprocessing
    gen = torch.Generator().manual_seed(0)
    noise = torch.rand(4, pre.channels, pre.height, pre.width, generator=gen)
    try:
        record = ctx.catalog.get(job.dataset)
        images = _dataset_samples(record, ctx.settings, meta)
    except (NotFound, DatasetUnavailable) as exc:
        log.warning("job %s: dataset %s unavailable (%s); parity on synthetic inputs", job.id, job.dataset, exc)
        synthetic = torch.rand(PARITY_INPUTS, pre.channels, pre.height, pre.width, generator=gen)
        return torch.cat([synthetic, noise]), f"synthetic: dataset {job.dataset} is unavailable"
    floats = images.float().div_(255.0)
    return torch.cat([floats, noise]), f"{len(images)} images of dataset {job.dataset} and {len(noise)} of noise"


def _spread(total: int, count: int) -> list[int]:
    """`count` indices spread evenly over `total` items (all of them when there are fewer)."""
    return torch.linspace(0, total - 1, min(count, total)).long().tolist() if total else []


def _dataset_samples(record: DatasetRecord, settings: Settings, meta: ModelMeta) -> torch.Tensor:
    """Up to PARITY_INPUTS images of the dataset at the model's input (uint8 N×C×H×W), spread over
    it, decoded through the same transform as training: only those, whatever the dataset's size
    (an upload's other files are listed, not read; a built-in's native arrays are what torchvision
    holds, not converted to the model's size, which for a 224-pixel model would be ~50× larger)."""
    pre = meta.preprocessing
    size = (pre.channels, pre.height, pre.width)
    if record.kind == "fake":
        labels = torch.tensor(_spread(FAKE_IMAGES, PARITY_INPUTS)) % len(FAKE_CLASSES)
        return fake_images(labels, *size, seed=0)
    if record.kind == "torchvision":
        # The test split: the smaller one, and any of the dataset's images serves the check.
        data = open_torchvision(record.id, settings.builtin_data_dir, download=settings.allow_download,
                                verify_checksums=settings.verify_builtin_checksums, train=False)
        return torch.from_numpy(np.stack([image_to_array(data[i][0], *size, pre.resize_size)
                                          for i in _spread(len(data), PARITY_INPUTS)]))
    root = settings.datasets_dir / record.id
    if not root.is_dir():
        raise DatasetUnavailable(f"dataset {record.id}'s files are not at {root}")
    files = sorted(path for path in root.rglob("*") if path.is_file())
    arrays = []
    for index in _spread(len(files), PARITY_INPUTS):
        try:
            with Image.open(files[index], formats=IMAGE_FORMATS) as image:  # the allowlist (core/images.py)
                arrays.append(image_to_array(image, *size, pre.resize_size))
        except (OSError, ValueError, Image.DecompressionBombError) as exc:
            log.warning("parity: skipping unreadable image %s: %s", files[index], exc)
    if not arrays:
        raise DatasetUnavailable(f"dataset {record.id} holds no readable images")
    return torch.from_numpy(np.stack(arrays))


def _parity(model: nn.Module, run: Callable[[np.ndarray], np.ndarray], inputs: torch.Tensor) -> float:
    """Largest |p_export - p_checkpoint| over the batch, and over a batch of one (the batch dimension is dynamic)."""
    with torch.no_grad():
        expected = torch.softmax(model(inputs), dim=1).numpy()
    batch = inputs.numpy().astype(np.float32)
    got = _softmax(run(batch))
    single = _softmax(run(batch[:1]))
    return float(max(np.abs(got - expected).max(), np.abs(single - expected[:1]).max()))


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


class _Progress:
    """Steps of the export as the job's progress, and the stop check between them."""

    def __init__(self, ctx: JobContext) -> None:
        self.ctx = ctx

    def step(self, done: int) -> None:
        reason = self.ctx.should_stop()
        if reason:
            raise StopJob(reason)
        self.ctx.reporter.progress(Progress(epoch=0, epochs=0, step=done, steps=_STEPS))
