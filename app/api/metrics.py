"""Prometheus metrics of one API process.

Two kinds: what this process sees itself (requests by route template and status, /predict
latency) in prometheus_client's own counters, and the cluster's state read from Redis at scrape
time (queue depths, jobs by status, devices, inference batch sizes, training throughput), so
every API replica reports the same truth and nothing goes stale between scrapes. Each app has
its own registry: two apps in one process (tests) never share counters.

Several API processes on one port (TORCHYARD_API_WORKERS > 1, app/server.py): a scrape lands on
any one of them, so the process-local counters are kept in prometheus_client's multiprocess mode
(one mmap file per process in the directory PROMETHEUS_MULTIPROC_DIR names, which the API parent
creates, sets before its children import prometheus_client, and removes) and every scrape sums all
the files, a dead process's included (a counter never goes down). The cluster collector stays in
the answering process's registry only, so its families appear once, not once per process.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from core import keys
from core.access.projects import project_of, visible
from core.devices import SERVING, DeviceRegistry
from core.queue import SHARED_TRAIN_QUEUES, queue_for_device
from core.schemas import Device, JobStatus

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's own variable, read once at its import


def multiprocess_dir() -> Path | None:
    """Where this process's counters live when the API runs as several processes, else None. The
    environment, not Settings: prometheus_client itself decides from this variable at import time
    whether its values are in memory or in files, and we must agree with it."""
    value = os.environ.get(MULTIPROC_ENV)
    return Path(value) if value else None


@dataclass(frozen=True)
class ClusterSource:
    """Where the scrape-time state is read from (the app's Services, once its lifespan built them)."""

    redis: redis.Redis
    devices: DeviceRegistry


class ClusterCollector(Collector):
    """Reads Redis on every scrape. A Redis outage yields `torchyard_redis_up 0`, not a failed scrape."""

    def __init__(self, source: Callable[[], ClusterSource | None]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("torchyard_redis_up", "1 when Redis answered this scrape")
        source = self._source()
        if source is None:
            up.add_metric([], 0)
            yield up
            return
        try:
            families = list(self._families(source))
        except redis.RedisError as exc:
            log.warning("metrics: Redis unavailable: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from families

    def _families(self, source: ClusterSource) -> Iterator[Metric]:
        client = source.redis
        devices = source.devices.all()

        # Queues: Celery's training queues and each device's prediction list.
        # Celery's shared queues, and each known device's own (train.dev.<id>).
        train_queues = [*SHARED_TRAIN_QUEUES, *(queue_for_device(d.id) for d in devices)]
        pipe = client.pipeline(transaction=False)
        for queue in train_queues:
            for name in keys.kombu_queue_lists(queue):
                pipe.llen(name)
        for device in devices:
            pipe.llen(keys.predict_queue(device.id))
        for status in JobStatus:
            pipe.zcard(keys.jobs_with_status(status.value))
        running_ids = client.zrange(keys.jobs_with_status(JobStatus.running.value), 0, -1)
        for job_id in running_ids:
            pipe.hmget(keys.job(job_id), "model", "device", "metrics", "project")
        replies = pipe.execute()

        n_prio = len(keys.KOMBU_PRIORITY_SUFFIXES)
        queue_depth = GaugeMetricFamily("torchyard_train_queue_depth",
                                        "training messages waiting in a Celery queue", labels=["queue"])
        for i, queue in enumerate(train_queues):
            queue_depth.add_metric([queue], sum(replies[i * n_prio:(i + 1) * n_prio]))
        yield queue_depth
        offset = len(train_queues) * n_prio

        predict_depth = GaugeMetricFamily("torchyard_predict_queue_depth",
                                          "prediction requests waiting for a device's worker", labels=["device"])
        for i, device in enumerate(devices):
            predict_depth.add_metric([device.id], replies[offset + i])
        yield predict_depth
        offset += len(devices)

        jobs = GaugeMetricFamily("torchyard_jobs", "jobs by status", labels=["status"])
        for i, status in enumerate(JobStatus):
            jobs.add_metric([status.value], replies[offset + i])
        yield jobs
        offset += len(JobStatus)

        throughput = GaugeMetricFamily("torchyard_job_images_per_second",
                                       "training throughput of a running job (its last finished epoch)",
                                       labels=["job", "model", "device"])
        for job_id, (model, device, metrics, project) in zip(running_ids, replies[offset:], strict=True):
            history = json.loads(metrics or "[]")
            if history and visible(project_of(project)):  # another project's job has no series for this key
                throughput.add_metric([job_id, model or "", device or ""], history[-1].get("images_per_second", 0))
        yield throughput

        yield from self._device_families(devices)

    @staticmethod
    def _device_families(devices: list[Device]) -> Iterator[Metric]:
        labels = ["device", "type"]
        up = GaugeMetricFamily("torchyard_device_up", "1 while the device's worker heartbeat is fresh", labels=labels)
        busy = GaugeMetricFamily("torchyard_device_busy", "1 while the device trains a job", labels=labels)
        used = GaugeMetricFamily("torchyard_device_memory_used_bytes", "device memory in use", labels=labels)
        total = GaugeMetricFamily("torchyard_device_memory_total_bytes", "device memory", labels=labels)
        util = GaugeMetricFamily("torchyard_device_utilization_percent", "device utilisation", labels=labels)
        loaded = GaugeMetricFamily("torchyard_device_loaded_models", "checkpoints resident for /predict",
                                   labels=labels)
        batches = CounterMetricFamily("torchyard_predict_batches", "inference batches run by the device's worker",
                                      labels=["device"])
        images = CounterMetricFamily("torchyard_predict_images", "images classified by the device's worker",
                                     labels=["device"])
        sizes = HistogramMetricFamily("torchyard_predict_batch_size",
                                      "images per inference batch (dynamic batching)", labels=["device"])
        for d in devices:
            key = [d.id, d.type]
            up.add_metric(key, 1 if d.status in SERVING else 0)
            busy.add_metric(key, 1 if d.status == "busy" else 0)
            loaded.add_metric(key, len(d.loaded_models))
            if d.memory_used_bytes is not None:
                used.add_metric(key, d.memory_used_bytes)
            if d.memory_total_bytes is not None:
                total.add_metric(key, d.memory_total_bytes)
            if d.utilization_percent is not None:
                util.add_metric(key, d.utilization_percent)
            stats = d.inference or {}
            histogram = {int(k): int(v) for k, v in (stats.get("batch_size_histogram") or {}).items()}
            batches.add_metric([d.id], stats.get("batches", sum(histogram.values())))
            images.add_metric([d.id], stats.get("images", sum(k * v for k, v in histogram.items())))
            buckets = [(str(le), sum(v for k, v in histogram.items() if k <= le)) for le in BATCH_BUCKETS]
            buckets.append(("+Inf", sum(histogram.values())))
            sizes.add_metric([d.id], buckets, sum_value=sum(k * v for k, v in histogram.items()))
        yield from (up, busy, used, total, util, loaded, batches, images, sizes)


class Metrics:
    """One app's registry: request counters the middleware feeds, plus the cluster collector.

    `multiprocess`: the directory of prometheus_client's multiprocess mode. The counters are then
    registered nowhere (their values go to this process's file) and the registry holds a
    MultiProcessCollector that sums every process's file at each scrape; registering them as
    well would count this process twice."""

    def __init__(self, multiprocess: Path | None = None) -> None:
        disable_created_metrics()  # no `_created` twin of every series: noise for a dashboard scrape
        self.registry = CollectorRegistry(auto_describe=False)
        own = self.registry if multiprocess is None else None
        self.requests = Counter("torchyard_http_requests", "HTTP requests by route template and status",
                                ["method", "route", "status"], registry=own)
        self.duration = Histogram("torchyard_http_request_duration_seconds",
                                  "time to the end of the response, by route template (event streams "
                                  "count their whole life)", ["route"], buckets=LATENCY_BUCKETS,
                                  registry=own)
        self.predict_latency = Histogram("torchyard_predict_latency_seconds",
                                         "POST /predict round trip in the API, successful calls",
                                         buckets=LATENCY_BUCKETS, registry=own)
        self.predict_orphaned = Counter("torchyard_predict_orphaned",
                                        "POST /predict requests whose worker process went away before answering; "
                                        "each is sent again to a live worker", registry=own)
        if multiprocess is not None:
            MultiProcessCollector(self.registry, path=str(multiprocess))
        self._series: dict[tuple[str, str, int], tuple[Any, Any, bool]] = {}

    def watch_cluster(self, source: Callable[[], ClusterSource | None]) -> None:
        self.registry.register(ClusterCollector(source))

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        series = self._series.get((method, route, status))
        if series is None:
            # `labels()` takes a lock and builds its key at every call: half this method's cost on
            # /predict, paid once per series instead. Bounded: routes are templates ("unmatched"
            # for any other path) and methods and statuses are few.
            series = self._series[(method, route, status)] = (
                self.requests.labels(method, route, str(status)), self.duration.labels(route),
                route == "/predict" and method == "POST" and status == 200)
        count, duration, predicted = series
        count.inc()
        duration.observe(seconds)
        if predicted:
            self.predict_latency.observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
