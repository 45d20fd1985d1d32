"""The `predict` handler: a trained job's model over every image of an uploaded dataset, as a
JSON-lines file (core/batch_predict.py is the API's side).

The model is loaded as /predict loads it (worker/checkpoint.load_model: `weights_only`,
`map_location` onto this worker's device, the checkpoint's recorded preprocessing), and each image
goes through the same decode (worker/serving/decode.decode_image) and the same forward graph (scale,
normalise, model, softmax in float32: worker/forward_graph.py), so a line's probabilities are
/predict's for that image.

The files are taken in one stable order (their paths under the dataset's root, sorted), decoded
by a thread pool a few batches ahead of the forward pass (never on the thread that runs it), and
each batch is one `inference_mode` forward. A file that does not decode gets an `error` line and
the job goes on.

Exactly once, in order, whatever dies: lines are appended to a working file of this delivery
(`scratch_path`, never promoted); about every `RESUME_INTERVAL_S` the file is flushed and fsynced,
then the job records, in one fenced write with its progress, the resume point: that file and how
many images and bytes of it are final. A redelivery (its worker was SIGKILLed, its lease
expired) copies exactly that many bytes into its own working file and goes on from the next
image; whatever the dead delivery wrote after its last recorded point is ignored. At the end the
working file becomes `results.jsonl` (`output_path`), promoted to the job's directory only if
this delivery finishes the job `succeeded` (a stale delivery's file is never promoted).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from core.batch_predict import RESULTS_FILE
from core.schemas import CheckpointInfo, Job, PredictSummary, Progress
from core.storage import sha256_file
from core.wire import strict_json
from worker.checkpoint import ModelMeta, load_model
from worker.forward_graph import ForwardGraph, build_forward
from worker.job_context import JobContext, JobFailed, JobOutcome, StopJob
from worker.serving.decode import decode_image

log = logging.getLogger(__name__)

# A CPU job's batch: measured on this 2-core host (the handler's rate, 10,000 32×32 PNGs, three jobs
# each, alternating): resnet18 2,429-2,477 images/s at 64, 2,823-2,948 at 128, 2,553-3,176 at 256;
# cifar_net 11,422-12,305, 12,292-13,435, 13,369-13,995. 128 takes most of the gain at half the
# memory of 256 (a batch's decoded images wait in shared memory PREFETCH_BATCHES deep).
DEFAULT_CPU_BATCH = 128
DEFAULT_GPU_BATCH = 256
# How often the working file is fsynced and the resume point and progress recorded: a redelivery
# redoes at most this much work, and the progress bar moves at this rate.
RESUME_INTERVAL_S = 0.5
# Batches decoded ahead of the forward pass: enough to hide a slow file, little memory.
PREFETCH_BATCHES = 4
WORKING_FILE = "results.part.jsonl"
DECODE_NICE = 10  # the decode processes' niceness, above the job's (_decode_at_lower_priority)


# ---------------------------------------------------------------------- the files, in order
def list_images(root: Path) -> list[str]:
    """Every file under `root` as a POSIX path relative to it, sorted: the job's one order (its
    resume point counts images of it). Dotfiles and dot-folders are not the dataset's."""
    found: list[str] = []
    for directory, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        base = Path(directory).relative_to(root)
        found.extend((base / name).as_posix() for name in files if not name.startswith("."))
    return sorted(found)


def true_label(relative: str) -> str:
    """A labelled (ImageFolder) dataset's class of a file: its folder under the root."""
    return relative.split("/", 1)[0]


# ---------------------------------------------------------------------- the lines
def result_line(file: str, values: Sequence[float], indices: Sequence[int], classes: Sequence[str],
                label: str | None = None) -> bytes:
    """One image's line: the top-k (label, index, probability), best first, as /predict answers them
    (core/wire.strict_json, so a non-finite probability is null there as here). 1.0 µs a line, on the
    thread that also runs the forward, against 2.6 for the string assembled from pre-encoded pieces
    it replaces and ~8 for json.dumps of the dict (a sixth of cifar_net's forward per image)."""
    doc: dict[str, Any] = {"file": file}
    if label is not None:
        doc["label"] = label
    doc["predictions"] = [{"label": classes[i], "index": i, "probability": p}
                          for p, i in zip(values, indices, strict=True)]
    return strict_json(doc) + b"\n"


def error_line(file: str, error: str, label: str | None = None) -> bytes:
    doc: dict[str, Any] = {"file": file}
    if label is not None:
        doc["label"] = label
    doc["error"] = error
    return strict_json(doc) + b"\n"


# ---------------------------------------------------------------------- the resume point
@dataclass(frozen=True)
class ResumePoint:
    """What of a delivery's working file is final: its first `bytes` bytes hold the lines of the
    first `images` files of the job's order (of `total`)."""

    images: int
    bytes: int
    total: int
    errors: int = 0
    correct: int = 0  # labelled: top-1 right, among the images that decoded

    @classmethod
    def parse(cls, raw: str | None) -> ResumePoint | None:
        if not raw:
            return None
        try:
            doc = json.loads(raw)
            return cls(images=int(doc["images"]), bytes=int(doc["bytes"]), total=int(doc["total"]),
                       errors=int(doc.get("errors", 0)), correct=int(doc.get("correct", 0)))
        except (ValueError, KeyError, TypeError):
            return None


def copy_prefix(source: Path, target: BinaryIO, point: ResumePoint) -> bool:
    """Copy the final part of an earlier delivery's working file into this one's. False (nothing
    usable copied; the caller starts over) when the file is gone or does not hold that many lines."""
    try:
        with open(source, "rb") as fh:
            prefix = fh.read(point.bytes)
    except OSError:
        return False
    if len(prefix) != point.bytes or prefix.count(b"\n") != point.images:
        return False
    target.write(prefix)
    return True


# ---------------------------------------------------------------------- decoding beside the forward
@dataclass
class DecodedBatch:
    start: int  # index of its first file in the job's order
    files: list[str]
    images: torch.Tensor | None  # uint8 N×C×H×W of the files that decoded, in order (None: none did)
    errors: dict[int, str]  # position in `files` → why it did not decode
    decode_cpu_s: float = 0.0  # CPU seconds its decoding took (read, decode, convert, stack)


class _BatchFiles(Dataset[DecodedBatch]):
    """Batch k of the job's files from `start` on, decoded (runs in a DataLoader worker process)."""

    def __init__(self, root: Path, files: Sequence[str], meta: ModelMeta, max_pixels: int, batch_size: int,
                 start: int) -> None:
        self.root = root
        self.files = files
        self.meta = meta
        self.max_pixels = max_pixels
        self.batch_size = batch_size
        self.start = start

    def __len__(self) -> int:
        return max(0, -(-(len(self.files) - self.start) // self.batch_size))

    def __getitem__(self, k: int) -> DecodedBatch:
        began = time.thread_time()
        first = self.start + k * self.batch_size
        files = list(self.files[first:first + self.batch_size])
        arrays: list[np.ndarray] = []
        errors: dict[int, str] = {}
        prefix = f"{self.root}{os.sep}"
        for position, name in enumerate(files):
            try:
                arrays.append(decode_image(read_file(prefix + name), self.meta, self.max_pixels))
            except OSError as exc:  # the file went away or cannot be read: say so without the server's path
                errors[position] = f"cannot read the file: {exc.strerror or type(exc).__name__}"
            except Exception as exc:  # BadImage: its message says why
                errors[position] = str(exc) or type(exc).__name__
        # One tensor per batch: it crosses to the job's process in shared memory, not pickled.
        images = torch.from_numpy(np.stack(arrays)) if arrays else None
        return DecodedBatch(first, files, images, errors, time.thread_time() - began)


def read_file(path: str) -> bytes:
    """A file's bytes with two system calls and no Python file object: 4 µs for a small image here
    against Path.read_bytes's 10, a sixth of decoding a 32×32 PNG."""
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _as_is(batch: Any) -> Any:
    """No collation: each item already is a whole batch (the DataLoader's batch_size is None)."""
    return batch


def decoded_batches(root: Path, files: Sequence[str], meta: ModelMeta, max_pixels: int, batch_size: int,
                    start: int, workers: int) -> DataLoader[DecodedBatch]:
    """The batches from file `start` on, in order, decoded by `workers` DataLoader processes a few
    batches ahead of the forward pass (never on the thread that runs it).

    Processes, not a thread pool: measured on this 2-core host (10,000 32×32 PNGs, cifar_net, batch
    64, load ~0.5), one DataLoader worker process fed the forward (one torch thread) at 13,000 to
    14,200 images/s, a decode thread at 8,100 (10,200 with the forward on two torch threads):
    decoding a small image is mostly Python holding the GIL (~50 µs a file: read 4 to 10, decode
    and convert 38), which a thread takes from the forward's own Python. Forked: cheap to start, and
    the child only decodes (no CUDA, no Redis). Each batch crosses back as one tensor in shared
    memory."""
    dataset = _BatchFiles(root, files, meta, max_pixels, batch_size, start)
    return DataLoader(dataset, batch_size=None, num_workers=workers, collate_fn=_as_is,
                      prefetch_factor=PREFETCH_BATCHES if workers else None, persistent_workers=False,
                      worker_init_fn=_decode_at_lower_priority)


def _decode_at_lower_priority(_: int) -> None:
    """A decode process yields the cores to the forward's threads when both want them: it runs a few
    batches ahead (PREFETCH_BATCHES), while a forward thread it preempts stalls its whole team at
    the next barrier. Measured on this 2-core host (the handler's rate, 10,000 32×32 PNGs, libgomp's
    spin capped: worker/device.openmp_environment; four jobs each, two stacks alternating):
    cifar_net 11,766 to 12,429 images/s at nice 10 against 9,281 to 11,634 at 0; resnet18 within
    this host's noise (1,799 to 2,612 against 2,237 to 2,389)."""
    os.nice(DECODE_NICE)


def thread_split(cuda: bool, cores: int | None = None) -> tuple[int, int]:
    """(decode worker processes, torch threads for the forward). On a CPU the cores are shared:
    half decode, the rest run the forward (2 cores: 1 and 1, measured above), until
    ForwardThreadChoice sees that decoding is light and gives the forward every core. On a GPU the forward
    needs one core to launch kernels; the others decode."""
    cores = cores or os.cpu_count() or 1
    if cuda:
        return max(1, min(8, cores - 1)), 1
    decode = max(1, min(8, cores // 2))
    return decode, max(1, cores - decode)


class ForwardThreadChoice:
    """A CPU job's torch threads, chosen once from its own second batch (the first warms up).

    thread_split leaves the decoders their cores; that is right when decoding is a fair share of
    the work and wastes them when the forward dwarfs it. Measured on this 2-core host (10,000 32×32
    PNGs, one decode process, the handler's loop): cifar_net, whose forward on one thread costs
    ~175 µs an image against ~50 µs to decode it, did 4,300 to 5,000 img/s on one torch thread and
    3,000 to 3,100 on two (the decoder preempts the spinning team); resnet18, ~3.2 ms against the
    same 50 µs, did 310 img/s on one thread and 494 to 515 on two, its floor. So when decoding, at
    the forward's pace, needs under DECODE_LIGHT of one core, the forward takes every core."""

    DECODE_LIGHT = 0.15  # of one core; cifar_net needs ~0.3 (keeps the split), resnet18 ~0.02

    def __init__(self, cores: int, split_threads: int) -> None:
        self.cores = cores
        self.threads = split_threads
        self._seen = 0

    def observe(self, decode_cpu_s: float, forward_s: float) -> int | None:
        """After a batch: the thread count to switch to, once, or None to keep the current one."""
        self._seen += 1
        if self._seen != 2 or self.threads >= self.cores or forward_s <= 0:
            return None
        decoder_cores = decode_cpu_s / forward_s  # the decoders' demand while the forward runs at this pace
        if decoder_cores < self.DECODE_LIGHT:
            self.threads = self.cores
            return self.threads
        return None


# ---------------------------------------------------------------------- the handler
def run_predict_job(job: Job, ctx: JobContext) -> JobOutcome:
    trained_id = str(job.params.get("trained_job") or "")
    top_k_asked = int(job.params.get("top_k") or 5)
    labeled = bool(job.params.get("labeled", True))
    root = ctx.settings.datasets_dir / job.dataset
    if not root.is_dir():
        raise JobFailed(f"dataset {job.dataset} has no files on this worker's storage ({root})")
    device = torch.device(ctx.device.torch_device)
    model, meta = load_model(ctx.paths.final(trained_id), device)
    graph = build_forward(model, meta.preprocessing, device)
    classes = meta.classes
    top_k = min(top_k_asked, len(classes))
    cuda = device.type == "cuda"
    batch_size = int(job.params.get("batch_size") or (DEFAULT_GPU_BATCH if cuda else DEFAULT_CPU_BATCH))
    files = list_images(root)
    total = len(files)
    ctx.set_classes(classes)

    working = ctx.scratch_path(WORKING_FILE)
    pointer = ctx.paths.relative(job.id, working)
    started = time.monotonic()
    with open(working, "wb") as out:
        point = _resume(job, ctx, out, total)
        resumed_from = point.images if point.images else None
        done, written, errors, correct = point.images, point.bytes, point.errors, point.correct
        first = done

        def checkpoint() -> None:
            """Make what is written final (fsync), then record it as the resume point with the progress."""
            out.flush()
            os.fsync(out.fileno())
            elapsed = max(time.monotonic() - started, 1e-9)
            progress = Progress(epoch=1, epochs=1, step=done, steps=total, images_done=done, images_total=total,
                                images_per_second=round((done - first) / elapsed, 1)).model_dump()
            at = ResumePoint(images=done, bytes=written, total=total, errors=errors, correct=correct)
            ctx.record({"progress": progress, "resume": pointer, "resume_at": asdict(at)}, ("progress", progress))

        workers, forward_threads = thread_split(cuda)
        loader = iter(decoded_batches(root, files, meta, ctx.settings.max_image_pixels, batch_size, done, workers))
        last_record = time.monotonic()
        threads_before = torch.get_num_threads()
        threads = None if cuda else ForwardThreadChoice(os.cpu_count() or 1, forward_threads)
        if not cuda:
            torch.set_num_threads(forward_threads)
        try:
            for batch in loader:
                reason = ctx.should_stop()
                if reason:
                    raise StopJob(reason)
                values: list[list[float]] = []
                indices: list[list[int]] = []
                if batch.images is not None:
                    began = time.perf_counter()
                    probabilities = _forward(graph, batch.images, device)
                    top = probabilities.topk(top_k, dim=1)
                    values, indices = top.values.tolist(), top.indices.tolist()
                    if threads is not None and (more := threads.observe(batch.decode_cpu_s,
                                                                        time.perf_counter() - began)):
                        torch.set_num_threads(more)
                        log.info("job %s: the forward dwarfs decoding; it runs on %d threads", job.id, more)
                chunk = bytearray()
                row = 0
                for position, name in enumerate(batch.files):
                    label = true_label(name) if labeled else None
                    if position in batch.errors:
                        chunk += error_line(name, batch.errors[position], label)
                        errors += 1
                        continue
                    chunk += result_line(name, values[row], indices[row], classes, label)
                    if label is not None and classes[indices[row][0]] == label:
                        correct += 1
                    row += 1
                out.write(chunk)
                written += len(chunk)
                done += len(batch.files)
                if time.monotonic() - last_record >= RESUME_INTERVAL_S:
                    checkpoint()
                    last_record = time.monotonic()
        finally:
            torch.set_num_threads(threads_before)
            del loader  # its worker processes stop now, not at the next garbage collection
        checkpoint()
    seconds = time.monotonic() - started
    # The working file stays this delivery's resume source until the job's files are settled; the
    # result is a second name for it (no copy), in the directory that is promoted on success.
    target = ctx.output_path(RESULTS_FILE)
    target.unlink(missing_ok=True)
    try:
        os.link(working, target)
    except OSError:
        shutil.copyfile(working, target)
    decoded = total - errors
    summary = PredictSummary(
        trained_job=trained_id, alias=job.params.get("alias"), images=total, errors=errors, top_k=top_k,
        labeled=labeled, accuracy=round(correct / decoded, 6) if labeled and decoded else None,
        seconds=round(seconds, 3), images_per_second=round((total - first) / max(seconds, 1e-9), 1),
        resumed_from_image=resumed_from, url=f"/jobs/{job.id}/results")
    ctx.record({"results": summary.model_dump()}, ("results", summary.model_dump()))
    log.info("job %s: %d images (%d errors) in %.1f s, %.0f images/s", job.id, total, errors, seconds,
             summary.images_per_second)
    return JobOutcome(checkpoint=CheckpointInfo(url=summary.url, sha256=sha256_file(target),
                                                bytes=target.stat().st_size))


def _resume(job: Job, ctx: JobContext, out: BinaryIO, total: int) -> ResumePoint:
    """Continue after an earlier delivery's recorded resume point, or start at the first image."""
    source = ctx.resume_state()
    point = ResumePoint.parse(ctx.delivery.call(ctx.store.raw_field, job.id, "resume_at"))
    if source is None or point is None:
        return ResumePoint(images=0, bytes=0, total=total)
    if point.total != total or not copy_prefix(source, out, point):
        log.warning("job %s: the resume point (%s) cannot be used; starting over from the first image", job.id,
                    source)
        out.seek(0)
        out.truncate()
        ctx.reporter.notice("restarted", {"images_done": 0},
                            "the earlier delivery's results could not be read back; starting over")
        return ResumePoint(images=0, bytes=0, total=total)
    ctx.record({"message": f"resumed after {point.images} of {total} images"},
               ("resumed", {"images_done": point.images, "images_total": total}))
    log.info("job %s: resumed after %d of %d images", job.id, point.images, total)
    return point


def _forward(graph: ForwardGraph, batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Probabilities (float32, on the CPU) of one uint8 batch: /predict's graph (worker/forward_graph.py)."""
    with torch.inference_mode(), torch.jit.optimized_execution(False):
        if device.type == "cuda":
            batch = batch.pin_memory().to(device, non_blocking=True)
        return graph.run(batch).cpu()
