"""Predictions on the worker's device: resident models, dynamic batching, threads of their own.

Inference has its own consumer, a Redis list per device, read by threads of the worker, so a
device that is training still answers: the training task holds Celery's only slot, and on a
GPU inference runs on a separate, high-priority CUDA stream, so it waits for at most the
kernels already queued, not for the job.

Three stages, so that the thread that feeds the device does nothing else:
- the intake thread takes requests off the list, decides when a batch is complete
  (worker/batching.BatchWindow) and decodes its images, split over the decode pool once they
  cost enough for threads to pay (`DecodeSplit`);
- the device thread (`torchyard-inference`) stacks the ready arrays into a staging buffer,
  copies them to the device (pinned, asynchronous, padded to a bucketed size on a GPU: see
  worker/batching.py) and runs the forward, a traced graph that holds no GIL while it runs
  (worker/forward_graph.py: an eager forward waited for the decoding threads at every operator);
- the decode pool also turns the probabilities into replies and sends them, one RPUSH per API
  process (its inbox), while the device computes the next batch.

The messages themselves (request, reply, statuses) are core/wire.py's; the resident models are
worker/model_cache.py's.
"""

from __future__ import annotations

import gc
import io
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import redis
import torch
from PIL import Image

from core import keys
from core.wire import (
    IMAGE_FORMATS,
    REPLY_TTL_S,
    MalformedMessage,
    PredictReply,
    PredictRequest,
    WarmedModel,
    WarmRequest,
)
from worker.batching import BatchWindow, HostStaging, bucket_size
from worker.checkpoint import CheckpointError, ModelMeta
from worker.cpu_threads import HEAVY_FORWARD_S, ForwardThreads, pin_to_one_thread, usable_cores
from worker.device import WorkerDevice
from worker.model_cache import ModelCache, ResidentModel
from worker.preprocess import apply_preprocessing

log = logging.getLogger(__name__)

POLL_S = 0.001  # the longest sleep between two polls of the list while a batch fills
POLL_MIN_S = 0.0002  # while a batch waits for the device, or while requests are arriving
INLINE_REPLY_IMAGES = 4  # a batch this small is answered by the device thread itself when no batch waits
DEVICE_POLL_S = 0.05  # how often an idle device thread looks whether a job started (it then leaves the cores)
HIGH_PRIORITY = -1  # torch.cuda.Stream: lower is higher; out-of-range values clamp to the highest


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
        self.forward_threads = 0  # a CPU device's torch threads for the forward now (0: not a CPU device)

    def failed(self) -> None:
        """A batch that could not be served (the intake and the device thread both count them)."""
        with self._lock:
            self.errors += 1

    def record(self, size: int) -> None:
        with self._lock:
            self.batches += 1
            self.images += size
            self.max_batch = max(self.max_batch, size)
            self.histogram[size] += 1

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"batches": self.batches, "images": self.images, "max_batch": self.max_batch,
                    "errors": self.errors, "forward_threads": self.forward_threads,
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


class DecodeSplit:
    """Over how many threads a batch's images are decoded: one while they are cheap, the pool once
    they are not.

    Pillow releases the GIL only inside its decoder, and a small image is mostly Python around
    that call, so two threads decoding small images mostly wait for each other. Measured on this
    2-core host, wall µs per image for 32 images on one thread against two: 32×32 PNG 23-37
    against 31-43, 32×32 JPEG 48 against 61, 48×48 PNG of noise 48 against 58; and the other way
    for 48×48 PNG 86 against 55, 64×64 JPEG 101 against 85, 128×128 JPEG 150 against 97. The
    encoded size does not tell them apart (the 48×48 PNG of noise is the largest file and among
    the cheapest to decode), so the intake thread times its own share in CPU time (which waits
    for the GIL do not inflate) and the split follows a running average of that."""

    POOL_FROM_S = 60e-6  # an image's decode CPU from which the pool pays: between 48 and 86 µs above
    WEIGHT = 0.2  # of the newest batch in the running average

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self.image_s: float | None = None  # running average of one image's decode CPU, once measured

    def chunks(self, images: int) -> int:
        """How many chunks (threads) a batch of `images` is decoded in."""
        if images <= 1 or self.image_s is None or self.image_s < self.POOL_FROM_S:
            return 1
        return min(self.threads, images)

    def observe(self, cpu_s: float, images: int) -> None:
        """The intake thread's share of a batch: `images` decoded in `cpu_s` of its CPU time."""
        if images <= 0:
            return
        one = cpu_s / images
        self.image_s = one if self.image_s is None else self.image_s + self.WEIGHT * (one - self.image_s)


@dataclass
class PreparedGroup:
    """One model's share of a batch, decoded and ready for the device thread."""

    job_id: str
    entry: ResidentModel
    arrays: list[np.ndarray] = field(default_factory=list)
    owners: list[tuple[PredictRequest, int]] = field(default_factory=list)  # request, index of its first image


class InferenceServer:
    def __init__(self, client: redis.Redis, device: WorkerDevice, cache: ModelCache, *, max_batch: int,
                 max_wait_ms: float, max_pixels: int, cpu_threads: int | None = None,
                 decode_threads: int | None = None, pad_to_buckets: bool | None = None,
                 job_running: Callable[[], bool] | None = None) -> None:
        self.redis = client
        self.device = device
        self.cache = cache
        self.max_batch = max_batch
        self.max_pixels = max_pixels
        # A CPU device's forward: all the cores for a heavy model (or `cpu_threads` for every model)
        # while no job runs on this worker, one for a light model, one while a job runs
        # (worker/cpu_threads.py says why).
        self.forward_threads = ForwardThreads(cpu_threads or usable_cores(), every_model=cpu_threads is not None)
        self.job_running = job_running or (lambda: False)
        self.decode_threads = decode_threads or min(4, usable_cores())
        self.decode_split = DecodeSplit(self.decode_threads)
        # Padding to bucketed sizes pays on a GPU (cuDNN tunes per shape) and costs on a CPU; the
        # tests turn it on for the CPU to run the same path.
        self.pad_to_buckets = device.kind == "cuda" if pad_to_buckets is None else pad_to_buckets
        self.queue = keys.predict_queue(device.id)
        self.stats = InferenceStats(cache)
        self.window = BatchWindow(max_batch, max_wait_ms / 1000)
        self._halt = threading.Event()
        self._ready: queue.Queue[list[PreparedGroup]] = queue.Queue(maxsize=1)
        self._device_busy = threading.Event()
        self._device_idle = threading.Event()  # its complement, to wait on
        self._device_idle.set()
        self._device_free_at = 0.0  # epoch s: when the device thread last finished a batch
        self._pool = ThreadPoolExecutor(self.decode_threads, thread_name_prefix="torchyard-decode",
                                        initializer=pin_to_one_thread)
        self._stream: Any = None
        self._staging: HostStaging | None = None
        self._warms: list[WarmRequest] = []  # taken off the list with the requests, served after them
        self._cores_free = threading.Event()  # the device thread holds no OpenMP team
        self._intake_thread = threading.Thread(target=self._intake_loop, name="torchyard-intake", daemon=True)
        self._device_thread = self._new_device_thread()

    def _new_device_thread(self) -> threading.Thread:
        return threading.Thread(target=self._device_loop, name="torchyard-inference", daemon=True)

    def start(self) -> None:
        if self.device.kind == "cpu":  # what the device thread sets first: so the first heartbeat says it too
            self.stats.forward_threads = self.forward_threads.wanted(self.job_running())
        if self.device.kind == "cuda":
            # Tuned once per input shape: batch sizes are bucketed (worker/batching.bucket_size). Set
            # before any model loads: a traced graph keeps the cuDNN flags it was traced under.
            torch.backends.cudnn.benchmark = True
        self._intake_thread.start()
        self._device_thread.start()

    def stop(self) -> None:
        self._halt.set()

    def join(self, timeout: float | None = None) -> None:
        self._intake_thread.join(timeout)
        while True:  # a device thread may have handed over to a fresh one meanwhile
            device_thread = self._device_thread
            device_thread.join(timeout)
            if device_thread is self._device_thread:
                break
        self._pool.shutdown(wait=False, cancel_futures=True)

    def release_cores(self, timeout_s: float = 10.0) -> None:
        """Before a job starts (`job_running` is true by now): wait until a CPU device's forward has
        left the cores to it, running on one thread with no OpenMP team (worker/cpu_threads.py).
        Bounded: a forward that takes longer delays the job's start by `timeout_s` at most."""
        if self.device.kind != "cpu" or self._halt.is_set() or not self._device_thread.is_alive():
            return
        if not self._cores_free.wait(timeout_s):
            log.warning("the /predict forward did not leave the cores within %gs; the job starts anyway", timeout_s)

    # ------------------------------------------------------------------ intake thread
    def _intake_loop(self) -> None:
        # The worker's imports, Celery and torch state live as long as the process: keep them out
        # of the collector's full passes, which scanned them all and stalled a batch ~200 ms each.
        gc.freeze()
        pin_to_one_thread()  # it loads models: their copies must not make an OpenMP team here
        while not self._halt.is_set():
            try:
                requests = self._collect()
                if requests:
                    groups = self._prepare(requests)
                    if groups:
                        self._hand_over(groups)
                if self._warms:
                    self._serve_warms()
            except redis.RedisError:
                log.warning("inference: Redis unavailable; retrying", exc_info=True)
                self._halt.wait(0.5)
            except Exception:
                log.exception("inference intake error")

    def _hand_over(self, groups: list[PreparedGroup]) -> None:
        while not self._halt.is_set():
            try:
                self._ready.put(groups, timeout=0.5)
                return
            except queue.Full:
                continue

    def _collect(self) -> list[PredictRequest]:
        """Block for a first request, then take what comes until the window says the batch is complete."""
        # BLPOP and an LPOP of what queued beside it, pipelined: Redis runs the LPOP as soon as the
        # BLPOP returns, so a lone request costs one round trip and a burst is taken whole.
        pipe = self.redis.pipeline(transaction=False)
        pipe.blpop([self.queue], timeout=1)
        pipe.lpop(self.queue, self.max_batch - 1)
        first, rest = pipe.execute()
        raw = ([first[1]] if first is not None else []) + (rest or [])
        if not raw:
            return []
        requests: list[PredictRequest] = []
        images = self._add(requests, raw)
        if not requests:
            return []
        # Poll rather than BLPOP: an idle Redis wakes for blocking timeouts only every 1/hz (100 ms
        # by default), far coarser than a batching window of a few milliseconds. Each poll is a
        # Redis call for the worker and for Redis: at most one a millisecond while the list is
        # quiet, one every POLL_MIN_S while requests are arriving or a batch waits for the device.
        first_queued_at = requests[0].queued_at
        arriving = True  # the last poll found requests: the rest of a burst is likely on its way
        while True:
            busy = self._busy()
            opened_at = max(first_queued_at, self._device_free_at)
            if self.window.ready(images, opened_at, now := time.time(), busy):
                break
            if self._device_busy.is_set():
                # Polls while the device computes only gather what it takes next: wait for it to be
                # free (woken that moment) or for a poll period, whichever is sooner.
                self._device_idle.wait(POLL_S)
            elif busy or arriving:
                # The API's requests of a burst land together, a fraction of a millisecond after the
                # first ones: measured at 32 clients (cifar_net), polling every POLL_S here took the
                # last of them 1.2 to 2.2 ms after they were queued, POLL_MIN_S 0.4 to 0.6 ms.
                time.sleep(POLL_MIN_S)
            else:
                time.sleep(min(POLL_S, max(POLL_MIN_S, self.window.deadline(opened_at) - now)))
            arrived = self.redis.lpop(self.queue, self.max_batch - images) or []
            arriving = bool(arrived)
            images += self._add(requests, arrived)
        self.window.observe(images)
        return requests

    def _busy(self) -> bool:
        """The device is computing, or a batch already waits for it."""
        return self._device_busy.is_set() or not self._ready.empty()

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

    def _prepare(self, requests: list[PredictRequest]) -> list[PreparedGroup]:
        """Group by model, decode every image in the pool, answer the requests that cannot run."""
        now = time.time()
        by_job: dict[str, list[PredictRequest]] = defaultdict(list)
        for request in requests:
            if request.deadline >= now:  # else the caller has given up already
                by_job[request.job_id].append(request)
        groups = []
        for job_id, group in by_job.items():
            try:
                entry = self.cache.get(job_id)
            except CheckpointError as exc:
                self._reply_errors(group, 409, str(exc))
                continue
            except Exception as exc:  # a failure answers its callers and never stops the thread
                self.stats.failed()
                log.exception("loading the model of job %s failed", job_id)
                self._reply_errors(group, 503, f"inference failed on {self.device.id}: {exc}")
                continue
            decoded = self._decode_all([image.data for request in group for image in request.images], entry.meta)
            prepared = PreparedGroup(job_id, entry)
            at = 0
            for request in group:
                mine = decoded[at:at + len(request.images)]
                at += len(request.images)
                failure = next(((image, d) for image, d in zip(request.images, mine, strict=True)
                                if isinstance(d, BadImage)), None)
                if failure is not None:  # the whole request is refused, naming the file at fault
                    image, bad = failure
                    self._reply_errors([request], bad.status, f"{image.filename or 'image'}: {bad}")
                    continue
                prepared.owners.append((request, len(prepared.arrays)))
                prepared.arrays.extend(d for d in mine if isinstance(d, np.ndarray))
            if prepared.arrays:
                groups.append(prepared)
        return groups

    def _decode_all(self, data: list[bytes], meta: ModelMeta) -> list[np.ndarray | BadImage]:
        """Every image decoded, in order: one contiguous chunk per decode thread (`DecodeSplit` says
        how many), the last chunk on this (the intake) thread while the pool does the others, so a
        lone image never changes threads. A pool task per image cost more in hand-offs than a 32×32
        PNG's decode (~30 µs)."""
        chunks = self.decode_split.chunks(len(data))
        size = -(-len(data) // chunks)
        parts = [data[i:i + size] for i in range(0, len(data), size)]
        pending = [self._pool.submit(_decode_chunk, part, meta, self.max_pixels) for part in parts[:-1]]
        began = time.thread_time()
        last = _decode_chunk(parts[-1], meta, self.max_pixels)
        self.decode_split.observe(time.thread_time() - began, len(parts[-1]))
        return [d for future in pending for d in future.result()] + last

    # ------------------------------------------------------------------ device thread
    def _device_loop(self) -> None:
        # The serving graphs run as traced, in this thread: no re-specialisation per batch size.
        with torch.jit.optimized_execution(False):
            self._serve_device()

    def _serve_device(self) -> None:
        if self.device.kind == "cuda":
            self._stream = torch.cuda.Stream(priority=HIGH_PRIORITY)
        self._staging = HostStaging(torch.device(self.device.torch_device), self.max_batch, pinned=self.device.kind == "cuda")
        self._threads = self._most_threads = 0  # this thread's torch threads now, and the most it used
        while not self._halt.is_set():
            if self.device.kind == "cpu":
                job_running = self.job_running()
                if ForwardThreads.must_hand_over(self.forward_threads.wanted(job_running), self._most_threads):
                    self._cores_free.clear()
                    self._device_thread = self._new_device_thread()  # one with no team, for the job's time
                    self._device_thread.start()
                    return
                self.stats.forward_threads = self.forward_threads.wanted(job_running)  # a heavy model's
                if self._most_threads <= 1:
                    self._cores_free.set()
                else:
                    self._cores_free.clear()
            try:
                groups = self._ready.get(timeout=DEVICE_POLL_S)
            except queue.Empty:
                continue
            self._device_idle.clear()
            self._device_busy.set()
            try:
                for group in groups:
                    self._run(group)
            finally:
                self._device_free_at = time.time()
                self._device_busy.clear()
                self._device_idle.set()

    def _run(self, group: PreparedGroup) -> None:
        if self.device.kind == "cpu":
            self._use_threads(group.entry)
        try:
            probabilities = torch.cat([self._forward(group.entry, group.arrays[i:i + self.max_batch])
                                       for i in range(0, len(group.arrays), self.max_batch)])
        except Exception as exc:  # a failure answers its callers and never stops the thread
            self.stats.failed()
            log.exception("inference for job %s failed", group.job_id)
            self._reply_errors([r for r, _ in group.owners], 503, f"inference failed on {self.device.id}: {exc}")
            return
        if len(group.arrays) <= INLINE_REPLY_IMAGES and self._ready.empty():
            self._send_results(group, probabilities)  # nothing waits for the device: spare a hand-off
        else:
            self._pool.submit(self._send_results, group, probabilities)

    def _use_threads(self, entry: ResidentModel) -> None:
        """This batch's torch threads on a CPU device, by the model's weight (worker/cpu_threads.py).

        The cores are marked taken before the job flag is read: a job that starts after the read
        waits in `release_cores` for the hand-over; one that started before it is seen here, and
        the batch runs on one thread, making no team."""
        heavy = entry.one_image_s is None or entry.one_image_s >= HEAVY_FORWARD_S
        if self.forward_threads.wanted(False, heavy) > 1:
            self._cores_free.clear()
        wanted = self.forward_threads.wanted(self.job_running(), heavy)
        if wanted != self._threads:
            torch.get_num_threads()  # torch's lazy per-thread start first, then ours
            torch.set_num_threads(wanted)
            self._threads, self._most_threads = wanted, max(self._most_threads, wanted)
        if self._most_threads <= 1:
            self._cores_free.set()

    def _forward(self, entry: ResidentModel, arrays: list[np.ndarray]) -> torch.Tensor:
        """Probabilities (on the host) of `arrays`, padded to a bucketed size where that pays."""
        assert self._staging is not None
        rows = bucket_size(len(arrays), self.max_batch) if self.pad_to_buckets else len(arrays)
        began = time.perf_counter()
        with torch.inference_mode():
            if self._stream is not None:
                with torch.cuda.stream(self._stream):
                    out = entry.forward.run(self._staging.upload(arrays, rows))[:len(arrays)].cpu()
            else:
                out = entry.forward.run(self._staging.upload(arrays, rows))[:len(arrays)]
        self.window.note_forward(time.perf_counter() - began, len(arrays))
        self.stats.record(len(arrays))
        return out

    # ------------------------------------------------------------------ replies (decode pool)
    def _send_results(self, group: PreparedGroup, probabilities: torch.Tensor) -> None:
        try:
            meta = group.entry.meta
            # One top-k for the whole group (the largest any request asked for), sliced per request.
            k = min(max(request.top_k for request, _ in group.owners), meta.num_classes)
            values, indices = probabilities.topk(k, dim=1)
            all_values, all_indices = values.tolist(), indices.tolist()
            replies: dict[str, list[str]] = defaultdict(list)  # by inbox: one RPUSH per API process
            for request, begin in group.owners:
                top_k = min(request.top_k, meta.num_classes)
                rows = [(image.filename, all_indices[begin + j][:top_k], all_values[begin + j][:top_k])
                        for j, image in enumerate(request.images)]
                reply = PredictReply.predictions(group.job_id, meta.architecture, self.device.id, meta.classes, rows)
                replies[request.reply_to].append(reply.encode_to(request.request_id))
            self._send_replies(replies)
        except Exception:
            log.exception("answering predictions of job %s failed", group.job_id)

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

    def _send_replies(self, replies: dict[str, list[str]]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for inbox, encoded in replies.items():
            pipe.rpush(inbox, *encoded)
            pipe.expire(inbox, REPLY_TTL_S)  # an API process that died: its inbox expires
        pipe.execute()

    def _reply_errors(self, requests: list[PredictRequest], status: int, detail: str) -> None:
        replies: dict[str, list[str]] = defaultdict(list)
        for request in requests:
            replies[request.reply_to].append(PredictReply.error(status, detail).encode_to(request.request_id))
        self._send_replies(replies)


def _decode_chunk(data: list[bytes], meta: ModelMeta, max_pixels: int) -> list[np.ndarray | BadImage]:
    decoded: list[np.ndarray | BadImage] = []
    for one in data:
        try:
            decoded.append(decode_image(one, meta, max_pixels))
        except BadImage as exc:
            decoded.append(exc)
    return decoded
