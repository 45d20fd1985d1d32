"""The batch prediction handler (the job kind whose wire value is `predict`): a trained job's model
over every image of an uploaded dataset, as a JSON-lines file (core/kinds/batch_predict/ is the
API's side).

The model is loaded as /predict loads it (worker/checkpoints/format.load_model: `weights_only`,
`map_location` onto this worker's device, the checkpoint's recorded preprocessing), and each image
goes through the same image → array transform (worker/data/image_array.decode_image) and the same
forward graph (scale, normalise, model, softmax in float32: worker/checkpoints/forward_graph.py),
so a line's probabilities are /predict's for that image.

The files are taken in one stable order (their paths under the dataset's root, sorted), decoded
by DataLoader worker processes a few batches ahead of the forward pass (never on the thread that
runs it: worker/data/batch_predict_loader.py), and each batch is one `inference_mode` forward. A
file that does not decode gets an `error` line and the job goes on.

Exactly once, in order, whatever dies (worker/checkpoints/batch_predict_results.py: the lines and
the resume point): lines are appended to a working file of this delivery (`scratch_path`, never
promoted); about every `RESUME_INTERVAL_S` the file is flushed and fsynced, then the job records,
in one fenced write with its progress, the resume point: that file and how many images and bytes
of it are final. A redelivery (its worker was SIGKILLed, its lease expired) copies exactly that
many bytes into its own working file and goes on from the next image; whatever the dead delivery
wrote after its last recorded point is ignored. At the end the working file becomes
`results.jsonl` (`output_path`), promoted to the job's directory only if this delivery finishes
the job `succeeded` (a stale delivery's file is never promoted).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import asdict
from typing import BinaryIO

import torch

from core.kinds.batch_predict.params import BatchPredictParams
from core.kinds.batch_predict.submit import RESULTS_FILE
from core.schemas import CheckpointInfo, Job, PredictSummary, Progress
from core.storage import sha256_file
from worker.checkpoints.batch_predict_results import (
    ResumePoint,
    copy_prefix,
    error_line,
    list_images,
    result_line,
    true_label,
)
from worker.checkpoints.format import load_model
from worker.checkpoints.forward_graph import ForwardGraph, build_forward
from worker.data.batch_predict_loader import ForwardThreadChoice, decoded_batches, thread_split
from worker.runtime.job_context import JobContext, JobFailed, JobOutcome, StopJob

log = logging.getLogger(__name__)

# How often the working file is fsynced and the resume point and progress recorded: a redelivery
# redoes at most this much work, and the progress bar moves at this rate.
RESUME_INTERVAL_S = 0.5
WORKING_FILE = "results.part.jsonl"


def run_batch_predict_job(job: Job, ctx: JobContext) -> JobOutcome:
    params = BatchPredictParams.of(job)  # resolved at submit (core/kinds/batch_predict/params.py)
    labeled = params.labeled
    root = ctx.settings.datasets_dir / job.dataset
    if not root.is_dir():
        raise JobFailed(f"dataset {job.dataset} has no files on this worker's storage ({root})")
    device = torch.device(ctx.device.torch_device)
    model, meta = load_model(ctx.paths.final(params.trained_job), device)
    graph = build_forward(model, meta.preprocessing, device)
    classes = meta.classes
    top_k = min(params.top_k, len(classes))
    cuda = device.type == "cuda"
    batch_size = params.batch_for(device.type)
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
        trained_job=params.trained_job, alias=params.alias, images=total, errors=errors, top_k=top_k,
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
    """Probabilities (float32, on the CPU) of one uint8 batch: /predict's graph (worker/checkpoints/forward_graph.py)."""
    with torch.inference_mode(), torch.jit.optimized_execution(False):
        if device.type == "cuda":
            batch = batch.pin_memory().to(device, non_blocking=True)
        return graph.run(batch).cpu()
