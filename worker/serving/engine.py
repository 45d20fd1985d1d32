"""The serving engine: a device's /predict stages, wired together.

Inference has its own consumer, a Redis list per device, read by threads of the worker, so a
device that is training still answers: the training task holds Celery's only slot. The stages,
each in its own module:

- transport (worker/serving/transport.py): the list in Redis, binary frames in, replies out, and
  Redis's clock;
- batching (worker/serving/batching.py): when a batch is complete (`BatchWindow`), the padded
  sizes and the staging buffers;
- decode (worker/serving/decode.py): image bytes → the model's input, over the worker's cores;
- the device loop (worker/serving/device_loop.py): the one thread that feeds the device;
- replies (worker/serving/replies.py): top-k answers, sent while the device computes the next batch.

The intake thread here takes requests off the list until the window says the batch is complete,
loads the models they ask for (worker/serving/model_cache.py; a model that was just loaded has its batch
shapes run once, so no request pays for cuDNN's tuning) and starts decoding the images (on the
decoding processes, or itself for cheap images); then it takes the next batch while that one
decodes. The assembly thread collects each batch's images in order, answers the requests whose
images cannot be decoded, and hands the rest to the device loop, which computes the previous
batch meanwhile. So decoding, computing and taking requests overlap, and the batches a device
computes are the batches the window formed, in order. Preload requests (an alias about to
move) ride the same list and are answered once the model is resident.

A request taken off the list is always answered: what cannot run is refused with its reason, a
decoding process that dies or stalls costs its chunk a retry (worker/serving/decode_processes.py),
and any other failure on the intake's path answers every request it had taken with a 503, never
silence (its caller would wait out the API's timeout). A model is loaded, traced and its shapes tuned
on the engine's stream (worker/serving/stream.py), as its batches are computed.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import redis
import torch

from core.config import Settings
from core.logs import RedisOutageLog
from core.wire import Encoding, PredictReply, PredictRequest, PreloadedModel, PreloadRequest
from worker.checkpoints.format import CheckpointError
from worker.data.device_jpeg import DeviceJpegDecoder
from worker.data.image_array import BadImage
from worker.device.cpu_threads import ForwardThreads, pin_to_one_thread, usable_cores
from worker.device.health import DeviceHealth
from worker.device.pinning import WorkerDevice
from worker.serving.batching import BatchWindow
from worker.serving.decode import Decoder, DevicePendingDecode, PendingDecode
from worker.serving.device_loop import DeviceLoop
from worker.serving.model_cache import ModelCache, ResidentModel
from worker.serving.replies import PreparedGroup, send_results
from worker.serving.stats import InferenceStats
from worker.serving.transport import Transport

log = logging.getLogger(__name__)

POLL_S = 0.001  # the longest sleep between two polls of the list while a batch fills
POLL_MIN_S = 0.0002  # while a batch waits for the device, or while requests are arriving
REPLY_THREADS = 2  # one answers a batch while the next one's answers may already be due
DECODING_AHEAD = 2  # batches decoding while the device loop holds one: the processes stay busy
DECODE_TIMEOUT_S: float = Settings.model_fields["predict_decode_timeout_s"].default
DECODE_BATCH_PIXELS: int = Settings.model_fields["decode_batch_pixels"].default


@dataclass
class Decoding:
    """One model's share of a batch while its images decode."""

    job_id: str
    entry: ResidentModel
    requests: list[PredictRequest]
    pending: PendingDecode | DevicePendingDecode
    encoding: Encoding = "image"


class InferenceServer:
    def __init__(self, client: redis.Redis, device: WorkerDevice, cache: ModelCache, *, max_batch: int,
                 max_wait_ms: float, max_pixels: int, cpu_threads: int | None = None,
                 decode_processes: int | None = None, decode_timeout_s: float = DECODE_TIMEOUT_S,
                 pad_to_buckets: bool | None = None, device_decode: bool = False,
                 decode_batch_pixels: int = DECODE_BATCH_PIXELS,
                 job_running: Callable[[], bool] | None = None, health: DeviceHealth | None = None,
                 on_broken: Callable[[str], None] = lambda reason: None) -> None:
        """`client` must not decode responses (requests are binary frames). A CPU device's forward
        runs on all the cores for a heavy model (or `cpu_threads` for every model) while no job
        runs on this worker, on one for a light model, on one while a job runs (worker/device/cpu_threads.py).
        Padding to bucketed sizes pays on a GPU and costs on a CPU; the tests turn it on for the
        CPU to run the same path. `device_decode`: a batch's JPEGs decoded on the device
        (worker/data/device_jpeg.py; the runtime sets it on a CUDA worker from TORCHYARD_DECODE, the
        tests on a CPU one to run its path: torchvision decodes there the same way)."""
        self.device = device
        self.cache = cache
        self.max_batch = max_batch
        self.transport = Transport(client, device.id)
        self.stats = InferenceStats(cache.stats)
        self.window = BatchWindow(max_batch, max_wait_ms / 1000)
        device_decoder = (DeviceJpegDecoder(torch.device(device.torch_device), max_pixels, decode_batch_pixels)
                          if device_decode else None)
        self.decoder = Decoder(decode_processes or usable_cores(), max_pixels, decode_timeout_s,
                               device_decoder=device_decoder, device_context=lambda: self.device_loop.stream())
        # Replies are sent from threads of their own while the device computes the next batch; torch
        # ops there (top-k) must not start an OpenMP team (worker/device/cpu_threads.py).
        self._replies = ThreadPoolExecutor(REPLY_THREADS, thread_name_prefix="torchyard-replies",
                                           initializer=pin_to_one_thread)
        self._halt = threading.Event()
        self._preloads: list[PreloadRequest] = []  # taken off the list with the requests, served after them
        self.device_loop = DeviceLoop(
            device, self._halt, max_batch=max_batch,
            pad_to_buckets=device.kind == "cuda" if pad_to_buckets is None else pad_to_buckets,
            forward_threads=ForwardThreads(cpu_threads or usable_cores(), every_model=cpu_threads is not None),
            job_running=job_running or (lambda: False), window=self.window, stats=self.stats,
            answer=self._answer, answer_later=self._answer_later,
            refuse=lambda group, status, detail: self.transport.send_errors([r for r, _ in group.owners], status, detail),
            health=health, on_broken=on_broken)
        self._intake_thread = threading.Thread(target=self._intake_loop, name="torchyard-intake", daemon=True)
        # Batches between the intake and the device loop, decoding; a bounded number ahead.
        self._decoding: queue.Queue[list[Decoding]] = queue.Queue(maxsize=DECODING_AHEAD)
        self._assembling = 0  # batches handed to the assembly and not yet to the device loop
        self._assembling_lock = threading.Lock()
        self._assembly_thread = threading.Thread(target=self._assembly_loop, name="torchyard-assembly", daemon=True)
        self._outage = RedisOutageLog(log, f"/predict intake of {device.id}")

    def start(self) -> None:
        if self.device.kind == "cuda":
            # Tuned once per input shape: batch sizes are bucketed (worker/serving/batching.py). Set
            # before any model loads: a traced graph keeps the cuDNN flags it was traced under.
            torch.backends.cudnn.benchmark = True
        self.device_loop.start()
        self._intake_thread.start()
        self._assembly_thread.start()

    def stop(self) -> None:
        self._halt.set()

    def join(self, timeout: float | None = None) -> None:
        self._intake_thread.join(timeout)
        self._assembly_thread.join(timeout)
        self.device_loop.join(timeout)
        self.decoder.shutdown()
        self._replies.shutdown(wait=False, cancel_futures=True)
        if not self._intake_thread.is_alive():
            self.transport.reader.close()  # the intake's own connection (a live intake still reads it)

    def release_cores(self, timeout_s: float = 10.0) -> None:
        """Before a job starts (`job_running` is true by now): wait until a CPU device's forward has
        left the cores to it. Bounded: a forward that takes longer delays the job's start by
        `timeout_s` at most."""
        self.device_loop.release_cores(timeout_s)

    # ------------------------------------------------------------------ intake thread
    def _intake_loop(self) -> None:
        # The worker's imports, Celery and torch state live as long as the process: keep them out
        # of the collector's full passes, which scan them all and stall a batch.
        gc.freeze()
        pin_to_one_thread()  # it loads models: their copies must not make an OpenMP team here
        while not self._halt.is_set():
            taken: list[PredictRequest] = []  # off the list, and not yet answered nor handed on
            try:
                self._collect(taken)
                self._outage.answered()
                if taken:
                    batch = self._prepare(taken)
                    taken = []  # each one answered by `_prepare` or handed on in `batch`
                    if batch:
                        self._count_assembling(+1)
                        self._put(batch)
                if self._preloads:
                    self._serve_preloads()
            except redis.RedisError as exc:  # one line when an outage starts, one when it ends
                self._outage.unavailable(exc)
                self._answer_lost(taken, f"Redis failed on {self.device.id}: {exc}")
                self._halt.wait(0.5)
            except Exception as exc:
                log.exception("inference intake error")
                self._answer_lost(taken, f"inference failed on {self.device.id}: {exc}")

    def _answer_lost(self, taken: list[PredictRequest], detail: str) -> None:
        """The last resort of the intake: requests it took and can no longer serve get a 503 now
        rather than their caller waiting out the timeout (unless Redis itself is what failed)."""
        if not taken:
            return
        self.stats.failed()
        try:
            self.transport.send_errors(taken, 503, detail)
        except Exception as exc:
            log.warning("%d /predict requests could not be answered (%s); their callers time out", len(taken), exc)

    def _collect(self, requests: list[PredictRequest]) -> None:
        """Block for a first request, then take what comes until the window says the batch is
        complete; each request is appended to `requests` as it is taken."""
        images = self.transport.decode(self.transport.take_first(self.max_batch), requests, self._preloads)
        if not requests:
            return
        # Poll rather than BLPOP: an idle Redis wakes for blocking timeouts only every 1/hz (100 ms
        # by default), far coarser than a batching window of a few milliseconds. Each poll is a
        # Redis call for the worker and for Redis: at most one a millisecond while the list is
        # quiet, one every POLL_MIN_S while requests are arriving or a batch waits for the device.
        first_queued_at = self.transport.local_time(requests[0].header.queued_at)
        arriving = True  # the last poll found requests: the rest of a burst is likely on its way
        loop = self.device_loop
        while True:
            busy = loop.waiting_or_computing() or self._assembling > 0
            opened_at = max(first_queued_at, loop.free_at)
            if self.window.ready(images, opened_at, now := time.time(), busy):
                break
            if loop.busy.is_set():
                # Polls while the device computes only gather what it takes next: wait for it to be
                # free (woken that moment) or for a poll period, whichever is sooner.
                loop.idle.wait(POLL_S)
            elif busy or arriving:
                # The API's requests of a burst land together, a fraction of a millisecond after the
                # first ones: polling fast here takes the rest of the burst into this batch.
                time.sleep(POLL_MIN_S)
            else:
                time.sleep(min(POLL_S, max(POLL_MIN_S, self.window.deadline(opened_at) - now)))
            arrived = self.transport.take_more(self.max_batch - images)
            arriving = bool(arrived)
            images += self.transport.decode(arrived, requests, self._preloads)
        self.window.observe(images)

    def _prepare(self, requests: list[PredictRequest]) -> list[Decoding]:
        """Group by model, start decoding each group's images, answer the requests that cannot run."""
        now = time.time()
        # A model's images and its preprocessed inputs (core/wire.py's encodings) are stacked apart.
        by_job: dict[tuple[str, Encoding], list[PredictRequest]] = defaultdict(list)
        for request in requests:
            if self.transport.local_time(request.header.deadline) >= now:  # else the caller has given up already
                by_job[(request.header.job_id, request.header.encoding)].append(request)
        batch = []
        for (job_id, encoding), group in by_job.items():
            try:
                entry = self._resident(job_id)
                if encoding == "fp32" and entry.preprocessed is None:  # traced and tuned once, as `_resident`'s
                    with self.device_loop.stream():
                        entry.preprocessed_forward(self.cache.device)
                        self.device_loop.tune(entry, "fp32")
            except CheckpointError as exc:
                self.transport.send_errors(group, 409, str(exc))
                continue
            except Exception as exc:  # a failure answers its callers and never stops the thread
                self.stats.failed()
                log.exception("loading the model of job %s failed", job_id)
                self.transport.send_errors(group, 503, f"inference failed on {self.device.id}: {exc}")
                continue
            try:
                items = [request.image(i)[1] for request in group for i in range(request.image_count)]
                pending: PendingDecode | DevicePendingDecode
                if encoding == "fp32":
                    shapes = [request.header.shape for request in group for _ in range(request.image_count)]
                    pending = self.decoder.start_tensors(items, shapes, entry.meta)
                else:
                    pending = self.decoder.start(items, entry.meta)
            except Exception as exc:
                self.stats.failed()
                log.exception("decoding the images of job %s failed", job_id)
                self.transport.send_errors(group, 503, f"decoding failed on {self.device.id}: {exc}")
                continue
            batch.append(Decoding(job_id, entry, group, pending, encoding))
        return batch

    def _put(self, batch: list[Decoding]) -> None:
        while not self._halt.is_set():
            try:
                self._decoding.put(batch, timeout=0.5)
                return
            except queue.Full:
                continue

    # ------------------------------------------------------------------ assembly thread
    def _assembly_loop(self) -> None:
        pin_to_one_thread()
        while not self._halt.is_set():
            try:
                batch = self._decoding.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                groups = [group for decoding in batch if (group := self._assemble(decoding)) is not None]
                if groups:
                    self.device_loop.hand_over(groups)
            except Exception as exc:  # a failure answers its callers and never stops the thread
                self.stats.failed()
                # A sticky device error from decoding on the device (nvJPEG: worker/data/device_jpeg.py)
                # takes the worker out of service as the forward's would (device_loop.DeviceLoop._run).
                health = self.device_loop.health
                reason = health.job_failed(exc) if health is not None else None
                if reason is None:
                    log.exception("assembling a batch failed")
                detail = (f"the device {self.device.id} is out of service: {reason}" if reason is not None
                          else f"inference failed on {self.device.id}")
                for decoding in batch:
                    self.transport.send_errors(decoding.requests, 503, detail)
                if reason is not None:
                    self.device_loop.on_broken(reason)
            finally:
                self._count_assembling(-1)

    def _count_assembling(self, change: int) -> None:
        with self._assembling_lock:
            self._assembling += change

    def _assemble(self, decoding: Decoding) -> PreparedGroup | None:
        """A group's decoded images, in order, for the device loop; a request with an image that
        cannot be decoded is refused whole, naming the file at fault."""
        decoded = decoding.pending.result()
        prepared = PreparedGroup(decoding.job_id, decoding.entry, encoding=decoding.encoding)
        at = 0
        for request in decoding.requests:
            mine = decoded[at:at + request.image_count]
            at += request.image_count
            failure = next(((i, d) for i, d in enumerate(mine) if isinstance(d, BadImage)), None)
            if failure is not None:
                index, bad = failure
                self.transport.send_errors([request], bad.status, f"{request.header.images[index][0] or 'image'}: {bad}")
                continue
            prepared.owners.append((request, len(prepared.arrays)))
            prepared.arrays.extend(d for d in mine if not isinstance(d, BadImage))  # host arrays or device rows
        return prepared if prepared.arrays else None

    def _resident(self, job_id: str) -> ResidentModel:
        """The job's model on the device; one that was just loaded has its batch shapes run once.
        All of it on the engine's stream: the checkpoint's copy onto the device, the trace and its
        probe (worker/serving/model_cache.py), the shape tuning."""
        with self.device_loop.stream():
            entry = self.cache.get(job_id)
            if not entry.tuned:
                self.device_loop.tune(entry)
                entry.tuned = True
        return entry

    def _answer(self, group: PreparedGroup, probabilities: torch.Tensor) -> None:
        send_results(self.transport, self.device.id, group, probabilities)

    def _answer_later(self, group: PreparedGroup, probabilities: torch.Tensor) -> None:
        """On a pool thread, while the device computes the next batch."""
        self._replies.submit(self._answer, group, probabilities)

    def _serve_preloads(self) -> None:
        """Load each preloaded job's model (an alias is about to move to it) and say when it is resident."""
        preloads, self._preloads = self._preloads, []
        for preload in preloads:
            if self.transport.local_time(preload.deadline) < time.time():
                continue  # the caller has given up already
            started = time.perf_counter()
            loaded = preload.job_id not in self.cache.resident()
            try:
                self._resident(preload.job_id)
                reply = PredictReply(200, PreloadedModel(job_id=preload.job_id, device=self.device.id, loaded=loaded,
                                                         seconds=round(time.perf_counter() - started, 4)).model_dump_json())
            except CheckpointError as exc:
                reply = PredictReply.error(409, str(exc))
            except Exception as exc:
                log.exception("preloading job %s failed", preload.job_id)
                reply = PredictReply.error(503, f"loading failed on {self.device.id}: {exc}")
            self.transport.send_preload_reply(preload, reply)
