"""Checkpoints resident on a worker's device for /predict: an LRU bounded by count and bytes.

Loading a checkpoint costs a file read, a host-to-device copy and a trace of its serving graph
(worker/checkpoints/forward_graph.py; tens of ms each for a resnet18), so each worker keeps the models it
served; a job whose model.pt was replaced is noticed by the file's identity (`file_signature`) and
loaded again.
Counters go out with the heartbeat (GET /devices → `inference.cache`), so loads, reloads and
evictions can be observed.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.storage import CheckpointPaths
from core.wire import Encoding
from worker.checkpoints.format import CheckpointError, ModelMeta, load_model
from worker.checkpoints.forward_graph import ForwardGraph, build_forward

log = logging.getLogger(__name__)


@dataclass
class ResidentModel:
    model: torch.nn.Module
    meta: ModelMeta
    forward: ForwardGraph  # uint8 batch on the device → probabilities; shares the model's parameters
    signature: tuple[int, ...]  # `file_signature` of the file it came from
    nbytes: int
    one_image_s: float | None = None  # a CPU device's one-image forward, timed at load on the loading thread
    tuned: bool = False  # its batch shapes have run once on the device (worker/serving/device_loop.tune)
    # float32 input in [0, 1] (preprocessed by the caller: the Open Inference Protocol's INPUT__0) →
    # probabilities; traced the first time such a request comes (`preprocessed_forward`), sharing the parameters.
    preprocessed: ForwardGraph | None = None

    def forward_for(self, encoding: Encoding) -> ForwardGraph:
        """The graph of a batch of `encoding`'s arrays: uint8 decoded images, or preprocessed float32."""
        if encoding == "fp32":
            assert self.preprocessed is not None, "preprocessed_forward runs when the model is taken for such a batch"
            return self.preprocessed
        return self.forward

    def preprocessed_forward(self, device: str | torch.device) -> ForwardGraph:
        """The float32 graph, traced now if this is its first use (on the loading thread)."""
        if self.preprocessed is None:
            self.preprocessed = build_forward(self.model, self.meta.preprocessing, device, preprocessed=True)
        return self.preprocessed


def file_signature(stat: os.stat_result) -> tuple[int, ...]:
    """What changes whenever a checkpoint's content can have changed. Every write of a model.pt is
    a fresh file renamed into place (core/storage.py), so a new version is a new inode, and the
    rename sets its ctime, which no user call can set back (mtime can be: a copy that keeps times,
    and two writes of the same size within a coarse clock's tick had the same (mtime, size))."""
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


class ModelCache:
    """Checkpoints resident on the device, least recently used evicted past count or bytes.

    A checkpoint file that changed (a job's model.pt replaced) is noticed by its `file_signature`
    on the next request and loaded again. Counters are published in the heartbeat
    (`inference.cache` in GET /devices) so loads, reloads and evictions can be observed."""

    def __init__(self, paths: CheckpointPaths, device: str | torch.device, max_count: int, max_bytes: int) -> None:
        self.paths = paths
        self.device = device
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._models: OrderedDict[str, ResidentModel] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.loads = 0
        self.reloads = 0
        self.evictions = 0
        self.eager = 0  # loads whose graph could not be traced (served eagerly; the worker's log says why)

    def get(self, job_id: str) -> ResidentModel:
        path = self.paths.final(job_id)
        try:
            stat = path.stat()
        except FileNotFoundError:
            # The path is the worker's business (its log); the caller is told what it can act on.
            log.warning("job %s: no checkpoint at %s", job_id, path)
            raise CheckpointError(f"job {job_id} has no checkpoint on this worker's storage (its files were "
                                  f"deleted, or the worker does not share the API's data dir)") from None
        signature = file_signature(stat)
        with self._lock:
            entry = self._models.get(job_id)
            if entry is not None and entry.signature == signature:
                self._models.move_to_end(job_id)
                self.hits += 1
                return entry
        stale = entry is not None
        entry = self._load(path, signature)
        with self._lock:
            self._models[job_id] = entry
            self._models.move_to_end(job_id)
            self.loads += 1
            self.reloads += stale
            self.eager += entry.forward.kind == "eager"
            self._evict()
        log.info("%s model of job %s (%s, %.1f MB, %s graph) onto %s", "reloaded changed" if stale else "loaded",
                 job_id, entry.meta.architecture, entry.nbytes / 1e6, entry.forward.kind, self.device)
        return entry

    def _load(self, path: Path, signature: tuple[int, ...]) -> ResidentModel:
        model, meta = load_model(path, self.device)  # torch.load(weights_only=True, map_location=device)
        nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        forward = build_forward(model, meta.preprocessing, self.device)
        one_image_s = _time_one_image(forward, meta) if torch.device(self.device).type == "cpu" else None
        return ResidentModel(model, meta, forward, signature, nbytes, one_image_s)

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

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"resident": len(self._models), "resident_bytes": sum(m.nbytes for m in self._models.values()),
                    "max_count": self.max_count, "max_bytes": self.max_bytes, "hits": self.hits,
                    "loads": self.loads, "reloads": self.reloads, "evictions": self.evictions, "eager": self.eager}


def _time_one_image(forward: ForwardGraph, meta: ModelMeta) -> float:
    """The fastest of a few one-image forwards on the calling thread (the intake thread, which runs
    on one torch thread): how heavy the model is, for worker/device/cpu_threads.ForwardThreads.

    In the thread's CPU time, after one untimed forward: a model loads at its first request, often
    under load, and on a busy host a wall-clock timing counts the time the thread waited for a core
    (a scheduler's slice, or another thread's turn with the GIL, is milliseconds long): it took
    cifar_net for a heavy model, whose forward then ran with an OpenMP team that spun a second core
    away at every request (docs/benchmarks.md, "The service's own CPU per request"). The first
    forward of a traced graph also runs slower than the rest.
    Stops after ~50 ms of forwards, so a big model costs its load four forwards at most."""
    pre = meta.preprocessing
    image = torch.zeros((1, pre.channels, pre.height, pre.width), dtype=torch.uint8)
    fastest, spent = float("inf"), 0.0
    with torch.inference_mode(), torch.jit.optimized_execution(False):
        forward.run(image)
        for _ in range(3):
            started = time.thread_time()
            forward.run(image)
            took = time.thread_time() - started
            fastest, spent = min(fastest, took), spent + took
            if spent > 0.05:
                break
    return fastest
