"""Predictions on the worker's device: resident models, dynamic batching, its own thread.

Inference has its own consumer, a Redis list per device, read by a thread of the worker, so a
device that is training still answers: the training task holds Celery's only slot, and on a
GPU inference runs on a separate CUDA stream, so it waits for at most the kernels already
queued, not for the job.

Batching: requests for the same model that arrive within `max_wait_ms` of the first one (timed
from when the API queued it) run as one batch of at most `max_batch` images. The window is only
opened when traffic says it can fill: a lone request on a quiet device (the previous batch held
one image and the previous request came more than `max_wait_ms` earlier) runs at once, since
waiting would only add latency. Under load, requests also pile up while a batch computes and the
next batch takes them all.

The messages themselves (request, reply, statuses) are core/wire.py's; the resident models are
worker/model_cache.py's.
"""

from __future__ import annotations

import gc
import io
import logging
import os
import threading
import time
from collections import defaultdict
from typing import Any

import numpy as np
import redis
import torch
from PIL import Image

from core import keys
from core.schemas import ImagePredictions, Prediction, PredictResponse
from core.wire import (
    IMAGE_FORMATS,
    REPLY_TTL_S,
    MalformedMessage,
    PredictReply,
    PredictRequest,
    WarmedModel,
    WarmRequest,
)
from worker.checkpoint import CheckpointError, ModelMeta
from worker.device import WorkerDevice
from worker.model_cache import ModelCache, ResidentModel
from worker.preprocess import apply_preprocessing, normalize

log = logging.getLogger(__name__)

POLL_S = 0.0002


class BadImage(Exception):
    """An upload the worker cannot turn into an input: 415, or 413 when it is too many pixels."""

    def __init__(self, detail: str, status: int = 415) -> None:
        super().__init__(detail)
        self.status = status


class InferenceStats:
    """Batches served, for the heartbeat (GET /devices → device.inference) and /metrics."""

    def __init__(self, cache: ModelCache) -> None:
        self.cache = cache
        self._lock = threading.Lock()
        self.batches = 0
        self.images = 0
        self.max_batch = 0
        self.errors = 0
        self.histogram: dict[int, int] = defaultdict(int)

    def record(self, size: int) -> None:
        with self._lock:
            self.batches += 1
            self.images += size
            self.max_batch = max(self.max_batch, size)
            self.histogram[size] += 1

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"batches": self.batches, "images": self.images, "max_batch": self.max_batch,
                    "errors": self.errors,
                    "batch_size_histogram": {str(k): v for k, v in sorted(self.histogram.items())},
                    "cache": self.cache.stats()}


def decode_image(data: bytes, meta: ModelMeta, max_pixels: int) -> np.ndarray:
    """Bytes → C×H×W uint8 with the model's recorded preprocessing; any failure is a BadImage."""
    pre = meta.preprocessing
    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as image:
            if image.width * image.height > max_pixels:
                raise BadImage(f"image has {image.width * image.height} pixels, over the limit of {max_pixels}", 413)
            return apply_preprocessing(image, pre)
    except BadImage:
        raise
    except Image.DecompressionBombError as exc:
        raise BadImage(str(exc), 413) from exc
    except Exception as exc:  # truncated, not an image, corrupt palette, ...
        raise BadImage(f"cannot decode image: {exc}") from exc


class InferenceServer(threading.Thread):
    def __init__(self, client: redis.Redis, device: WorkerDevice, cache: ModelCache, *, max_batch: int,
                 max_wait_ms: float, max_pixels: int, cpu_threads: int | None = None) -> None:
        super().__init__(name="torchyard-inference", daemon=True)
        self.redis = client
        self.device = device
        self.cache = cache
        self.max_batch = max_batch
        self.max_wait_s = max_wait_ms / 1000
        self.max_pixels = max_pixels
        self.cpu_threads = cpu_threads or max(1, (os.cpu_count() or 1) // 2)
        if device.kind == "cpu":
            # Pin the calling (main, training) thread's own OpenMP thread count now: torch gives a
            # thread that has not run a parallel op yet the count last set by *any* thread, and the
            # inference thread is about to set a smaller one for itself.
            torch.get_num_threads()
        self.queue = keys.predict_queue(device.id)
        self.stats = InferenceStats(cache)
        self._halt = threading.Event()
        self._stream: Any = None
        self._last_arrival = 0.0  # when the API queued the latest request seen (epoch s)
        self._last_batch = 0  # images in the latest batch collected
        self._warms: list[WarmRequest] = []  # taken off the list with the requests, served after them

    def run(self) -> None:
        # The worker's imports, Celery and torch state live as long as the process: keep them out
        # of the collector's full passes, which scanned them all and stalled a batch ~200 ms each.
        gc.freeze()
        if self.device.kind == "cuda":
            self._stream = torch.cuda.Stream()
        else:
            # On a CPU device, inference ops run on part of the cores and leave the rest to the API,
            # Redis and training: small batches gain little from more threads, and threads that
            # must meet at every op stall whenever one of them is preempted.
            torch.set_num_threads(self.cpu_threads)
        while not self._halt.is_set():
            try:
                requests = self._collect()
                if requests:
                    self._serve(requests)
                if self._warms:
                    self._serve_warms()
            except redis.RedisError:
                log.warning("inference: Redis unavailable; retrying", exc_info=True)
                self._halt.wait(0.5)
            except Exception:
                log.exception("inference loop error")

    def stop(self) -> None:
        self._halt.set()

    # ------------------------------------------------------------------ batching
    def _collect(self) -> list[PredictRequest]:
        """Block for a first request, take what is queued, then maybe wait out the batching window."""
        first = self.redis.blpop([self.queue], timeout=1)
        if first is None:
            return []
        requests: list[PredictRequest] = []
        images = self._add(requests, [first[1]])
        if not requests:
            return []
        if images < self.max_batch:
            images += self._add(requests, self.redis.lpop(self.queue, self.max_batch) or [])
        if images < self.max_batch and self._worth_waiting(requests):
            # The window is timed from when the API queued the first request, not from now.
            remaining = requests[0].queued_at + self.max_wait_s - time.time()
            deadline = time.monotonic() + min(max(remaining, 0.0), self.max_wait_s)
            # Poll rather than BLPOP: Redis enforces blocking timeouts only every 1/hz (100 ms by
            # default), far coarser than a batching window of a few milliseconds.
            while images < self.max_batch and time.monotonic() < deadline:
                time.sleep(POLL_S)
                images += self._add(requests, self.redis.lpop(self.queue, self.max_batch) or [])
        self._last_batch = images
        self._last_arrival = max(r.queued_at for r in requests)
        return requests

    def _worth_waiting(self, requests: list[PredictRequest]) -> bool:
        if len(requests) > 1 or self._last_batch > 1:
            return True
        return requests[0].queued_at - self._last_arrival < self.max_wait_s

    def _add(self, requests: list[PredictRequest], raw: list[str]) -> int:
        images = 0
        for item in raw:
            if WarmRequest.is_warm(item):
                try:
                    self._warms.append(WarmRequest.decode(item))
                except MalformedMessage as exc:
                    log.warning("dropped a malformed warm request (%s): %.200r", exc, item)
                continue
            try:
                request = PredictRequest.decode(item)
            except MalformedMessage as exc:
                log.warning("dropped a malformed prediction request (%s): %.200r", exc, item)
                continue
            images += len(request.images)
            requests.append(request)
        return images

    def _serve(self, requests: list[PredictRequest]) -> None:
        now = time.time()
        by_job: dict[str, list[PredictRequest]] = defaultdict(list)
        for request in requests:
            if request.deadline < now:
                continue  # the caller has given up already
            by_job[request.job_id].append(request)
        for job_id, group in by_job.items():
            try:
                self._serve_model(job_id, group)
            except Exception as exc:  # a failure answers its callers and never stops the thread
                self.stats.errors += 1
                log.exception("inference for job %s failed", job_id)
                for request in group:
                    self._reply_error(request, 503, f"inference failed on {self.device.id}: {exc}")

    def _serve_model(self, job_id: str, group: list[PredictRequest]) -> None:
        try:
            entry = self.cache.get(job_id)
        except CheckpointError as exc:
            for request in group:
                self._reply_error(request, 409, str(exc))
            return
        arrays: list[np.ndarray] = []
        owners: list[tuple[PredictRequest, int]] = []  # request, index of its first image
        for request in group:
            decoded = []
            for image in request.images:
                try:
                    decoded.append(decode_image(image.data, entry.meta, self.max_pixels))
                except BadImage as exc:  # the whole request is refused, naming the file at fault
                    self._reply_error(request, exc.status, f"{image.filename or 'image'}: {exc}")
                    break
            else:
                owners.append((request, len(arrays)))
                arrays.extend(decoded)
        if not arrays:
            return
        probabilities = torch.cat([self._forward(entry, arrays[i:i + self.max_batch])
                                   for i in range(0, len(arrays), self.max_batch)])
        classes = entry.meta.classes
        pipe = self.redis.pipeline(transaction=False)
        for request, begin in owners:
            top_k = min(request.top_k, entry.meta.num_classes)
            values, indices = probabilities[begin:begin + len(request.images)].topk(top_k, dim=1)
            results = [ImagePredictions(filename=image.filename, predictions=[
                Prediction(label=classes[i], index=i, probability=p) for p, i in zip(ps, ix, strict=True)])
                for image, ps, ix in zip(request.images, values.tolist(), indices.tolist(), strict=True)]
            response = PredictResponse(job_id=job_id, model=entry.meta.architecture, device=self.device.id,
                                       results=results)
            self._queue_reply(pipe, request, PredictReply.ok(response))
        pipe.execute()

    def _forward(self, entry: ResidentModel, arrays: list[np.ndarray]) -> torch.Tensor:
        batch = torch.from_numpy(np.stack(arrays))
        with torch.inference_mode():
            if self._stream is not None:
                with torch.cuda.stream(self._stream):
                    x = normalize(batch.pin_memory().to(self.device.torch_device, non_blocking=True),
                                  entry.mean, entry.std)
                    out = torch.softmax(entry.model(x).float(), dim=1).cpu()
            else:
                x = normalize(batch, entry.mean, entry.std)
                out = torch.softmax(entry.model(x).float(), dim=1)
        self.stats.record(len(arrays))
        return out

    def _serve_warms(self) -> None:
        """Load each warmed job's model (an alias is about to move to it) and say when it is resident."""
        warms, self._warms = self._warms, []
        for warm in warms:
            if warm.deadline < time.time():
                continue  # the caller has given up already
            started = time.perf_counter()
            loaded = warm.job_id not in self.cache.resident()
            try:
                self.cache.get(warm.job_id)
                reply = PredictReply(200, WarmedModel(job_id=warm.job_id, device=self.device.id, loaded=loaded,
                                                      seconds=round(time.perf_counter() - started, 4)).model_dump_json())
            except CheckpointError as exc:
                reply = PredictReply.error(409, str(exc))
            except Exception as exc:
                log.exception("warming job %s failed", warm.job_id)
                reply = PredictReply.error(503, f"loading failed on {self.device.id}: {exc}")
            pipe = self.redis.pipeline(transaction=False)
            pipe.rpush(warm.reply_to, reply.encode())
            pipe.expire(warm.reply_to, REPLY_TTL_S)
            pipe.execute()

    @staticmethod
    def _queue_reply(pipe: Any, request: PredictRequest, reply: PredictReply) -> None:
        pipe.rpush(request.reply_to, reply.encode())
        pipe.expire(request.reply_to, REPLY_TTL_S)

    def _reply_error(self, request: PredictRequest, status: int, detail: str) -> None:
        pipe = self.redis.pipeline(transaction=False)
        self._queue_reply(pipe, request, PredictReply.error(status, detail))
        pipe.execute()
