"""The worker's heartbeat thread.

A solo-pool Celery worker answers no ping while it trains, so liveness cannot come from
Celery. This thread, independent of the task, publishes the device state every interval,
renews the running job's lease, and sweeps other workers' expired leases.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from app.core.devices import DeviceRegistry, utc_now
from app.core.jobs import JobStore
from worker.device import WorkerDevice, describe
from worker.runner import WorkerState

log = logging.getLogger(__name__)

SWEEP_EVERY_S = 2.0


class Heartbeat(threading.Thread):
    def __init__(self, device: WorkerDevice, instance: str, registry: DeviceRegistry, store: JobStore,
                 state: WorkerState, loaded_models: Callable[[], list[str]], interval_s: float,
                 extra: Callable[[], dict] = dict) -> None:
        super().__init__(name="torchyard-heartbeat", daemon=True)
        self.device = device
        self.instance = instance
        self.registry = registry
        self.store = store
        self.state = state
        self.loaded_models = loaded_models
        self.interval_s = interval_s
        self.extra = extra
        self._halt = threading.Event()
        self._last_sweep = 0.0
        self._last_info: dict = {"name": device.worker_name, "memory_total_bytes": None,
                                 "memory_used_bytes": None, "utilization_percent": None}

    def snapshot(self, status: str | None = None) -> dict:
        job = self.state.current_job
        return {
            "id": self.device.id, "type": self.device.kind, "index": self.device.index,
            **self._describe(),
            "worker": self.device.worker_name, "status": status or ("busy" if job else "idle"),
            "current_job": job, "loaded_models": self.loaded_models(), "last_heartbeat": utc_now(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "pid": os.getpid(),
            **self.extra(),
        }

    def _describe(self) -> dict:
        """Live device info; if reading it fails once, the last good reading, so the worker still
        reports alive (a liveness signal must not depend on NVML or a CUDA query)."""
        try:
            self._last_info = describe(self.device)
        except Exception:
            log.warning("could not read %s's live info; reporting the last reading", self.device.id, exc_info=True)
        return self._last_info

    def beat(self) -> None:
        if not self.registry.publish(self.device.id, self.instance, self.snapshot()):
            log.error("device %s is now held by another worker instance", self.device.id)
        job, token = self.state.current_job, self.state.current_token
        if job and token and not self.store.renew_lease(job, token):
            self.state.lease_lost.set()
        if time.monotonic() - self._last_sweep >= SWEEP_EVERY_S:
            self._last_sweep = time.monotonic()
            for job_id in self.store.sweep_expired_leases():
                log.warning("job %s: its worker stopped renewing the lease; redelivered", job_id)

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                self.beat()
            except Exception:  # Redis restarting: keep beating, redis-py reconnects
                log.warning("heartbeat failed; retrying", exc_info=True)
            self._halt.wait(self.interval_s)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)
        try:
            self.registry.release(self.device.id, self.instance, self.snapshot(status="offline"))
        except Exception:
            log.warning("could not mark %s offline", self.device.id, exc_info=True)
