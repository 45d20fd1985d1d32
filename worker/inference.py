"""Predictions on the worker's device: resident models, dynamic batching, its own thread.

Inference has its own consumer, a Redis list per device, read by a thread of the worker, so a
device that is training still answers: the training task holds Celery's only slot, and on a
GPU inference runs on a separate CUDA stream, so it waits for at most the kernels already
queued, not for the job. Requests that arrive within `max_wait_ms` of the first one, for the
same model, run as one batch.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import threading
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import redis
import torch
from PIL import Image

from app.core.devices import predict_queue
from app.core.storage import CheckpointPaths
from worker.checkpoint import CheckpointError, ModelMeta, load_model
from worker.device import WorkerDevice
from worker.preprocess import image_to_array, normalize, stats_tensors

log = logging.getLogger(__name__)

REPLY_TTL_S = 60
POLL_S = 0.0002


class BadImage(Exception):
    pass


@dataclass
class ResidentModel:
    model: torch.nn.Module
    meta: ModelMeta
    mean: torch.Tensor
    std: torch.Tensor
    signature: tuple[int, int]  # (mtime_ns, size) of the file it came from
    nbytes: int


class ModelCache:
    """Checkpoints resident on the device, least recently used evicted past count or bytes."""

    def __init__(self, paths: CheckpointPaths, device: str, max_count: int, max_bytes: int) -> None:
        self.paths = paths
        self.device = device
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._models: OrderedDict[str, ResidentModel] = OrderedDict()
        self._lock = threading.Lock()
        self.loads = 0
        self.evictions = 0

    def get(self, job_id: str) -> ResidentModel:
        path = self.paths.final(job_id)
        try:
            stat = path.stat()
        except FileNotFoundError:
            raise CheckpointError(f"job {job_id} has no checkpoint on this worker's storage ({path})") from None
        signature = (stat.st_mtime_ns, stat.st_size)
        with self._lock:
            entry = self._models.get(job_id)
            if entry is not None and entry.signature == signature:
                self._models.move_to_end(job_id)
                return entry
        entry = self._load(path, signature)
        with self._lock:
            self._models[job_id] = entry
            self._models.move_to_end(job_id)
            self._evict()
        return entry

    def _load(self, path: Path, signature: tuple[int, int]) -> ResidentModel:
        model, meta = load_model(path, self.device)  # torch.load(weights_only=True, map_location=device)
        mean, std = stats_tensors(meta.preprocessing, self.device)
        nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        self.loads += 1
        return ResidentModel(model, meta, mean, std, signature, nbytes)

    def _evict(self) -> None:
        while len(self._models) > 1 and (
            len(self._models) > self.max_count or sum(m.nbytes for m in self._models.values()) > self.max_bytes
        ):
            evicted, _ = self._models.popitem(last=False)
            self.evictions += 1
            log.info("evicted model of job %s from the device cache", evicted)

    def resident(self) -> list[str]:
        with self._lock:
            return list(self._models)


@dataclass
class BatchStats:
    batches: int = 0
    images: int = 0
    max_batch: int = 0
    histogram: dict[int, int] = field(default_factory=lambda: defaultdict(int))

    def record(self, size: int) -> None:
        self.batches += 1
        self.images += size
        self.max_batch = max(self.max_batch, size)
        self.histogram[size] += 1

    def as_dict(self) -> dict[str, Any]:
        return {"batches": self.batches, "images": self.images, "max_batch": self.max_batch,
                "batch_size_histogram": {str(k): v for k, v in sorted(self.histogram.items())}}


def decode_image(data: bytes, meta: ModelMeta, max_pixels: int) -> np.ndarray:
    """Bytes → C×H×W uint8 with the model's recorded preprocessing; any failure is a BadImage."""
    pre = meta.preprocessing
    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.width * image.height > max_pixels:
                raise BadImage(f"image has {image.width * image.height} pixels, over the limit of {max_pixels}")
            return image_to_array(image, pre.channels, pre.height, pre.width)
    except BadImage:
        raise
    except Exception as exc:  # truncated, not an image, decompression bomb, ...
        raise BadImage(f"cannot decode image: {exc}") from exc


class InferenceServer(threading.Thread):
    def __init__(self, client: redis.Redis, device: WorkerDevice, cache: ModelCache, *, max_batch: int,
                 max_wait_ms: float, max_pixels: int) -> None:
        super().__init__(name="torchyard-inference", daemon=True)
        self.redis = client
        self.device = device
        self.cache = cache
        self.max_batch = max_batch
        self.max_wait_s = max_wait_ms / 1000
        self.max_pixels = max_pixels
        self.queue = predict_queue(device.id)
        self.stats = BatchStats()
        self._stop = threading.Event()
        self._stream = None

    def run(self) -> None:
        if self.device.kind == "cuda":
            self._stream = torch.cuda.Stream()
        while not self._stop.is_set():
            try:
                requests = self._collect()
                if requests:
                    self._serve(requests)
            except redis.RedisError:
                log.warning("inference: Redis unavailable; retrying", exc_info=True)
                self._stop.wait(0.5)
            except Exception:
                log.exception("inference loop error")

    def stop(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------------ batching
    def _collect(self) -> list[dict[str, Any]]:
        """Block for a first request, then gather more until the batch is full or max_wait passed."""
        first = self.redis.blpop([self.queue], timeout=1)
        if first is None:
            return []
        requests = [json.loads(first[1])]
        images = len(requests[0]["images"])
        deadline = time.monotonic() + self.max_wait_s
        while images < self.max_batch:
            more = self.redis.lpop(self.queue, self.max_batch)
            if more:
                for raw in more:
                    requests.append(json.loads(raw))
                    images += len(requests[-1]["images"])
                continue
            # Poll rather than BLPOP: Redis enforces blocking timeouts only every 1/hz (100 ms by
            # default), far coarser than a batching window of a few milliseconds.
            if time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
        return requests

    def _serve(self, requests: list[dict[str, Any]]) -> None:
        now = time.time()
        by_job: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for request in requests:
            if request.get("deadline", now + 1) < now:
                continue  # the caller has given up already
            by_job[request["job_id"]].append(request)
        for job_id, group in by_job.items():
            self._serve_model(job_id, group)

    def _serve_model(self, job_id: str, group: list[dict[str, Any]]) -> None:
        try:
            entry = self.cache.get(job_id)
        except CheckpointError as exc:
            for request in group:
                self._reply(request, {"ok": False, "status": 409, "detail": str(exc)})
            return
        arrays: list[np.ndarray] = []
        owners: list[tuple[dict[str, Any], int, int]] = []  # request, first index, count
        for request in group:
            try:
                decoded = [decode_image(base64.b64decode(img["data"]), entry.meta, self.max_pixels)
                           for img in request["images"]]
            except BadImage as exc:
                self._reply(request, {"ok": False, "status": 415, "detail": str(exc)})
                continue
            owners.append((request, len(arrays), len(decoded)))
            arrays.extend(decoded)
        if not arrays:
            return
        probabilities = self._forward(entry, arrays)
        self.stats.record(len(arrays))
        for request, begin, count in owners:
            top_k = max(1, min(int(request.get("top_k", 5)), entry.meta.num_classes))
            results = []
            for offset, image in enumerate(request["images"]):
                probs, indices = probabilities[begin + offset].topk(top_k)
                results.append({"filename": image.get("filename"), "predictions": [
                    {"label": entry.meta.classes[i], "index": i, "probability": p}
                    for p, i in zip(probs.tolist(), indices.tolist(), strict=True)]})
            self._reply(request, {"ok": True, "job_id": job_id, "model": entry.meta.architecture,
                                  "device": self.device.id, "results": results})

    def _forward(self, entry: ResidentModel, arrays: list[np.ndarray]) -> torch.Tensor:
        batch = torch.from_numpy(np.stack(arrays))
        with torch.inference_mode():
            if self._stream is not None:
                with torch.cuda.stream(self._stream):
                    x = normalize(batch.pin_memory().to(self.device.torch_device, non_blocking=True), entry.mean, entry.std)
                    out = torch.softmax(entry.model(x).float(), dim=1).cpu()
            else:
                x = normalize(batch, entry.mean, entry.std)
                out = torch.softmax(entry.model(x).float(), dim=1)
        return out

    def _reply(self, request: dict[str, Any], body: dict[str, Any]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.rpush(request["reply_to"], json.dumps(body))
        pipe.expire(request["reply_to"], REPLY_TTL_S)
        pipe.execute()
