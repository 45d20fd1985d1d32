"""The worker's heartbeat thread, and the cluster's recovery sweep it runs.

A solo-pool Celery worker answers no ping while it trains, so liveness cannot come from
Celery. This thread, independent of the task, renews the running job's lease first (nothing
slow before it: not NVML, not a publish), publishes the device state, and sweeps.

The sweep is the cluster's recovery, run by one live worker at a time (a short Redis lock):
expired leases are redelivered, queued jobs whose message was lost are re-sent, and ended jobs'
files left unsettled by a dead owner are settled (core/jobs/recovery.py). Two guards keep it from doing
harm after an outage, when nobody could renew and every lease looks expired:

- a worker sweeps only once it has itself seen Redis answer, beat after beat without a stall,
  for at least a lease TTL, so every live worker has renewed by then;
- it compares expiries with Redis TIME read in a round trip that did not stall, so a clock read
  after a freeze (with renewals still queued behind it) is never used.
A beat that took longer than `max(interval, 1 s)` counts as a stall; leases must outlast
`interval + stall` (the defaults: 1 s, 1 s and a 20 s lease).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

from core import keys
from core.clock import redis_now, utc_now_iso
from core.devices import DeviceRegistry
from core.gangs import GangScheduler
from core.jobs import JobStore
from core.logs import RedisOutageLog
from core.redis import OUTAGE_ERRORS
from core.schemas import Device
from core.storage import CheckpointPaths
from worker.device.health import DeviceHealth
from worker.device.info import DeviceInfo, describe, host_memory_total
from worker.device.pinning import WorkerDevice
from worker.runtime.state import WorkerState

log = logging.getLogger(__name__)

SWEEP_EVERY_S = 2.0
# A TIME round trip slower than this may have waited out a freeze: its clock is not used.
MAX_CLOCK_ROUND_TRIP_S = 0.5
# Settling a job's files failed here (another host's disk?): look again after this.
SETTLE_RETRY_S = 60.0


class Sweeper:
    """The recovery sweep (see the module docstring); `maybe_sweep` is called by every beat."""

    def __init__(self, store: JobStore, paths: CheckpointPaths, instance: str, lease_ttl_s: float,
                 every_s: float = SWEEP_EVERY_S, *, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.paths = paths
        self.instance = instance
        self.lease_ttl_s = lease_ttl_s
        self.every_s = every_s
        self.monotonic = monotonic  # the clock its waits are measured on (a test drives its own)
        self._last = float("-inf")

    def maybe_sweep(self, redis_healthy_for_s: float) -> None:
        if redis_healthy_for_s < self.lease_ttl_s or self.monotonic() - self._last < self.every_s:
            return
        self._last = self.monotonic()
        client = self.store.redis
        if not client.set(keys.SWEEP_LOCK, self.instance, nx=True, px=int(self.every_s * 1000)):
            return  # another live worker sweeps this round
        asked = self.monotonic()
        now = redis_now(client)
        round_trip = self.monotonic() - asked
        if round_trip > MAX_CLOCK_ROUND_TRIP_S:
            log.info("sweep skipped: Redis took %.1f s to tell the time", round_trip)
            return
        for job_id in self.store.sweep_expired_leases(now):
            log.warning("job %s: its worker stopped renewing the lease; redelivered", job_id)
        self.store.reconcile_dispatch(now)
        self.store.release_held(now)  # quota holds: a lease that expired, a new UTC day, a quota raised
        for pending in self.store.pending_settlements(now):
            if self.paths.settle_files(pending.job_id, pending.token, pending.promote):
                self.store.settled(pending.job_id)
                client.hincrby(keys.RECOVERY_STATS, "files_settled_by_sweep", 1)
                log.warning("job %s: settled the files its worker left (promoted %s)", pending.job_id,
                            ", ".join(pending.promote) or "nothing")
            else:
                self.store.postpone_settlement(pending.job_id, SETTLE_RETRY_S)


class Heartbeat(threading.Thread):
    def __init__(self, device: WorkerDevice, instance: str, registry: DeviceRegistry, store: JobStore,
                 state: WorkerState, loaded_models: Callable[[], list[str]], interval_s: float,
                 inference_stats: Callable[[], dict[str, Any]] | None = None, *,
                 sweeper: Sweeper | None = None, health: DeviceHealth | None = None,
                 take_out_of_service: Callable[[str], None] | None = None, gangs: GangScheduler | None = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        super().__init__(name="torchyard-heartbeat", daemon=True)
        self.device = device
        self.instance = instance
        self.registry = registry
        self.store = store
        self.state = state
        self.loaded_models = loaded_models
        self.interval_s = interval_s
        self.inference_stats = inference_stats
        self.sweeper = sweeper
        self.gangs = gangs
        self.health = health or DeviceHealth()
        self.take_out_of_service = take_out_of_service or (lambda reason: self.state.out_of_service.set())
        self.stall_s = max(interval_s, 1.0)
        self.monotonic = monotonic  # the clock beats and stalls are measured on (a test drives its own)
        self._halt = threading.Event()
        self._last_ok: float | None = None
        self._healthy_since = monotonic()
        self._name = device.worker_name
        self._outage = RedisOutageLog(log, f"worker {device.worker_name}")

    def snapshot(self, status: Literal["idle", "busy", "offline", "broken"] | None = None) -> Device:
        job = self.state.current_job
        info = self._describe()
        fault = self.health.broken
        if status is None:
            status = "broken" if fault else ("busy" if job else "idle")
        return Device(
            id=self.device.id, type=self.device.kind, index=self.device.index, name=info.name,
            memory_total_bytes=info.memory_total_bytes, memory_used_bytes=info.memory_used_bytes,
            utilization_percent=info.utilization_percent, worker=self.device.worker_name,
            status=status, current_job=job, loaded_models=self.loaded_models(),
            last_heartbeat=utc_now_iso(), cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
            pid=os.getpid(), inference=self.inference_stats() if self.inference_stats else None, fault=fault,
            host_memory_total_bytes=host_memory_total(),  # job admission (core/admission.py)
        )

    def _describe(self) -> DeviceInfo:
        """Live device info. If it cannot be read, no figures (never an old reading as if current);
        several failures in a row, or a sticky error, take the worker out of service."""
        if self.health.broken:
            return DeviceInfo(self._name, None, None, None)
        try:
            info = describe(self.device)
        except Exception as exc:
            log.warning("could not read %s's live info", self.device.id, exc_info=True)
            broken = self.health.probe_failed(exc)
            if broken:
                self.take_out_of_service(broken)
            return DeviceInfo(self._name, None, None, None)
        self.health.probe_ok()
        self._name = info.name  # the name does not change; the figures are never reused
        return info

    def beat(self) -> None:
        started = self.monotonic()
        job, token = self.state.current_job, self.state.current_token
        if job and token and self.state.leased and not self.store.renew_lease(job, token):
            self.state.lease_lost_by(token)
        if not self.registry.publish(self.device.id, self.instance, self.snapshot()):
            self._taken_over()
        done = self.monotonic()
        if self._last_ok is None or done - self._last_ok > self.interval_s + self.stall_s or done - started > self.stall_s:
            self._healthy_since = done  # Redis (or this process) was away or stalled: start counting again
        self._last_ok = done
        if self.sweeper is not None and not self.health.broken:
            self.sweeper.maybe_sweep(done - self._healthy_since)
        if self.gangs is not None and not self.health.broken:
            self.gangs.run_once()  # data-parallel jobs whose devices are free now (core/gangs/scheduler.py)

    def _taken_over(self) -> None:
        """Another worker instance holds this device now: this one's alive key lapsed (the process
        was frozen or stalled past the TTL) and a process started for the same device took it. Two
        processes must not serve one device, and the newer one is the registry's: this one goes out
        of service (no sweep, no gang scheduling from it; the job in hand requeued at its next step;
        the consumer stopped; exit EXIT_OUT_OF_SERVICE, for its supervisor to decide)."""
        if self.health.broken is not None:
            return  # told once; the worker is on its way out
        holder = self.registry.state(self.device.id) or {}
        reason = (f"device {self.device.id} was taken over by another worker instance "
                  f"({holder.get('worker', 'unknown')}, pid {holder.get('pid', '?')}) while this one (pid {os.getpid()}) "
                  f"did not renew its heartbeat for longer than its TTL")
        log.error("%s; this worker stops taking jobs and exits", reason)
        self.health.taken_out_of_service(reason)
        self.take_out_of_service(reason)

    def run(self) -> None:
        while not self._halt.is_set():
            self.tick()
            self._halt.wait(self.interval_s)

    def tick(self) -> None:
        """One beat of the thread's loop: an outage (or any error) is noted and the loop goes on;
        a beat that failed on an outage starts the count of healthy time again."""
        try:
            self.beat()
            self._outage.answered()
        except OUTAGE_ERRORS as exc:  # Redis restarting or away: keep beating, redis-py reconnects
            self._last_ok = None
            self._outage.unavailable(exc)  # once per outage, and once when it answers again
        except Exception:
            log.exception("heartbeat error; going on")

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)
        try:
            self.registry.release(self.device.id, self.instance,
                                  self.snapshot(status="broken" if self.health.broken else "offline"))
        except Exception:
            log.warning("could not mark %s offline", self.device.id, exc_info=True)
