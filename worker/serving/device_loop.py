"""The device stage: the one thread that feeds the device, and nothing else.

It takes a batch the intake has decoded, stacks it into a host staging buffer, copies it to the
device (pinned and asynchronous on a GPU, padded to a bucketed size there so cuDNN tunes a
handful of shapes: worker/serving/batching.py), and runs the model's serving graph, a traced
graph that holds no GIL while it runs (worker/checkpoints/forward_graph.py), on the engine's high-priority
CUDA stream on a GPU (worker/serving/stream.py, where a model's load, trace and shape tuning go too),
so a training job's kernels do not hold it back. The probabilities go to the
replies stage on a pool thread, while this thread takes the next batch.

An error here is classified like a training job's (worker/device/health.py): a sticky device
error (an illegal memory access, a device-side assert) takes the worker out of service at once,
through the same path a job's would, rather than answering 503 until the heartbeat's probes fail.

On a CPU device the forward's torch threads follow worker/device/cpu_threads.py: all the cores for a
heavy model while no job runs, one for a light one, one while a job runs, when this thread hands
over to a fresh one (a thread that has run an OpenMP team keeps it).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from core.wire import Encoding
from worker.device.cpu_threads import HEAVY_FORWARD_S, ForwardThreads
from worker.device.health import DeviceHealth
from worker.device.pinning import WorkerDevice
from worker.serving.batching import BatchWindow, HostStaging, bucket_size, buckets
from worker.serving.model_cache import ResidentModel
from worker.serving.replies import PreparedGroup
from worker.serving.stats import InferenceStats
from worker.serving.stream import ServingStream

log = logging.getLogger(__name__)

DEVICE_POLL_S = 0.05  # how often an idle device thread looks whether a job started (it then leaves the cores)
INLINE_REPLY_IMAGES = 4  # a batch this small is answered by the device thread itself when no batch waits


class DeviceLoop:
    def __init__(self, device: WorkerDevice, halt: threading.Event, *, max_batch: int, pad_to_buckets: bool,
                 forward_threads: ForwardThreads, job_running: Callable[[], bool], window: BatchWindow,
                 stats: InferenceStats, answer: Callable[[PreparedGroup, torch.Tensor], None],
                 answer_later: Callable[[PreparedGroup, torch.Tensor], None],
                 refuse: Callable[[PreparedGroup, int, str], None], health: DeviceHealth | None = None,
                 on_broken: Callable[[str], None] = lambda reason: None) -> None:
        self.device = device
        self.halt = halt
        self.max_batch = max_batch
        self.pad_to_buckets = pad_to_buckets
        self.forward_threads = forward_threads
        self.job_running = job_running
        self.window = window
        self.stats = stats
        self.answer, self.answer_later, self.refuse = answer, answer_later, refuse
        self.health = health
        self.on_broken = on_broken
        self.ready: queue.Queue[list[PreparedGroup]] = queue.Queue(maxsize=1)
        self.busy = threading.Event()
        self.idle = threading.Event()  # its complement, to wait on
        self.idle.set()
        self.free_at = 0.0  # local epoch s: when the last batch finished
        self.cores_free = threading.Event()  # the device thread holds no OpenMP team
        self.stream = ServingStream(device.kind, device.torch_device)  # a null context on a CPU
        self._staging: HostStaging | None = None
        self._threads = self._most_threads = 0  # this thread's torch threads now, and the most it used
        self.thread = self._new_thread()

    def _new_thread(self) -> threading.Thread:
        return threading.Thread(target=self._loop, name="torchyard-inference", daemon=True)

    def start(self) -> None:
        if self.device.kind == "cpu":  # set first, so that the first heartbeat says it too
            self.stats.forward_threads = self.forward_threads.wanted(self.job_running())
        self.stream.open()
        self.thread.start()

    def join(self, timeout: float | None) -> None:
        while True:  # the thread may have handed over to a fresh one meanwhile
            thread = self.thread
            thread.join(timeout)
            if thread is self.thread:
                return

    def waiting_or_computing(self) -> bool:
        return self.busy.is_set() or not self.ready.empty()

    def hand_over(self, groups: list[PreparedGroup]) -> None:
        """From the intake: the next batch, as soon as the previous one has been taken."""
        while not self.halt.is_set():
            try:
                self.ready.put(groups, timeout=0.5)
                return
            except queue.Full:
                continue

    def release_cores(self, timeout_s: float) -> None:
        """Before a job starts: wait until a CPU device's forward has left the cores to it."""
        if self.device.kind != "cpu" or self.halt.is_set() or not self.thread.is_alive():
            return
        if not self.cores_free.wait(timeout_s):
            log.warning("the /predict forward did not leave the cores within %gs; the job starts anyway", timeout_s)

    def tune(self, entry: ResidentModel, encoding: Encoding = "image") -> None:
        """Every batch shape this device will use tuned: run once as the model loads (on the loading
        thread, on the engine's stream), so that cuDNN picks its kernels then and not under traffic:
        on a GPU, the bucketed sizes; waited for on that stream alone, never behind a training
        step. A CPU runs every size from 1 to max_batch and has no per-shape tuning to hoist."""
        if self.device.kind != "cuda":
            return
        pre = entry.meta.preprocessing
        device = torch.device(self.device.torch_device)
        dtype = torch.float32 if encoding == "fp32" else torch.uint8  # a preprocessed input's graph: its own shapes
        with torch.inference_mode(), torch.jit.optimized_execution(False), self.stream():
            for size in buckets(self.max_batch):
                entry.forward_for(encoding).run(torch.zeros((size, pre.channels, pre.height, pre.width), dtype=dtype,
                                                            device=device))
        self.stream.synchronize()

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        # The serving graphs run as traced, in this thread: no re-specialisation per batch size.
        with torch.jit.optimized_execution(False):
            self._serve()

    def _serve(self) -> None:
        if self._staging is None:
            self._staging = HostStaging(torch.device(self.device.torch_device), self.max_batch)
        self._threads = self._most_threads = 0
        while not self.halt.is_set():
            if self.device.kind == "cpu" and self._leave_cores_if_a_job_runs():
                return
            try:
                groups = self.ready.get(timeout=DEVICE_POLL_S)
            except queue.Empty:
                continue
            self.idle.clear()
            self.busy.set()
            try:
                for group in groups:
                    self._run(group)
            finally:
                self.free_at = time.time()
                self.busy.clear()
                self.idle.set()

    def _leave_cores_if_a_job_runs(self) -> bool:
        """True when this thread has handed over to a fresh one (a job started: one thread, no team)."""
        job_running = self.job_running()
        if ForwardThreads.must_hand_over(self.forward_threads.wanted(job_running), self._most_threads):
            self.cores_free.clear()
            self.thread = self._new_thread()  # one with no team, for the job's time
            self.thread.start()
            return True
        self.stats.forward_threads = self.forward_threads.wanted(job_running)  # a heavy model's
        if self._most_threads <= 1:
            self.cores_free.set()
        else:
            self.cores_free.clear()
        return False

    def _run(self, group: PreparedGroup) -> None:
        if self.device.kind == "cpu":
            self._use_threads(group.entry)
        try:
            if self.health is not None:
                self.health.inject_fault()  # the CPU twin of a device that breaks mid-forward (tests)
            probabilities = torch.cat([self._forward(group, group.arrays[i:i + self.max_batch])
                                       for i in range(0, len(group.arrays), self.max_batch)])
        except Exception as exc:  # a failure answers its callers and never stops the thread
            self.stats.failed()
            reason = self.health.job_failed(exc) if self.health is not None else None
            if reason is not None:
                self.refuse(group, 503, f"the device {self.device.id} is out of service: {reason}")
                self.on_broken(reason)
                return
            log.exception("inference for job %s failed", group.job_id)
            self.refuse(group, 503, f"inference failed on {self.device.id}: {exc}")
            return
        if len(group.arrays) <= INLINE_REPLY_IMAGES and self.ready.empty():
            self.answer(group, probabilities)  # nothing waits for the device: spare a hand-off
        else:
            self.answer_later(group, probabilities)

    def _use_threads(self, entry: ResidentModel) -> None:
        """This batch's torch threads on a CPU device, by the model's weight (worker/device/cpu_threads.py).

        The cores are marked taken before the job flag is read: a job that starts after the read
        waits in `release_cores` for the hand-over; one that started before it is seen here, and
        the batch runs on one thread, making no team."""
        heavy = entry.one_image_s is None or entry.one_image_s >= HEAVY_FORWARD_S
        if self.forward_threads.wanted(False, heavy) > 1:
            self.cores_free.clear()
        wanted = self.forward_threads.wanted(self.job_running(), heavy)
        if wanted != self._threads:
            torch.get_num_threads()  # torch's lazy per-thread start first, then ours
            torch.set_num_threads(wanted)
            self._threads, self._most_threads = wanted, max(self._most_threads, wanted)
        if self._most_threads <= 1:
            self.cores_free.set()

    def _forward(self, group: PreparedGroup, arrays: list[np.ndarray | torch.Tensor]) -> torch.Tensor:
        """Probabilities (on the host) of `arrays` (of `group`'s encoding), padded to a bucketed size where that pays."""
        forward = group.entry.forward_for(group.encoding)
        assert self._staging is not None
        rows = bucket_size(len(arrays), self.max_batch) if self.pad_to_buckets else len(arrays)
        began = time.perf_counter()
        with torch.inference_mode(), self.stream():  # on a CPU `.cpu()` is the tensor itself
            out = forward.run(self._staging.upload(arrays, rows))[:len(arrays)].cpu()
        self.window.note_forward(time.perf_counter() - began, len(arrays))
        self.stats.record(len(arrays))
        return out
