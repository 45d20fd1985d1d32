"""One delivered job, start to finish: claim it, run the handler for its kind, record how it ended.

Everything a job of any kind shares lives here: the claim (only the current delivery token of a
queued job runs), the stop reasons checked between units of work (device out of service,
shutdown, lost lease, cancel), and the terminal transitions. What a kind does is its handler's
(`HANDLERS`, worker/kinds/<kind>.py); how its writes are fenced and its files promoted is
worker/runtime/delivery.py's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from core import tracking
from core.config import Settings
from core.datasets import DatasetCatalog
from core.errors import NotFound
from core.jobs import JobStore, NotOwner
from core.redis import OUTAGE_ERRORS
from core.schemas import JobKind, JobStatus
from core.storage import CheckpointPaths
from core.sweeps.records import nudge
from worker.checkpoints.format import CheckpointError
from worker.data.datasets import DatasetUnavailable
from worker.device.cpu_threads import run_in_own_thread
from worker.device.health import DeviceHealth
from worker.device.pinning import WorkerDevice
from worker.gang.member import GangMember, GangServices
from worker.gang.rank import GANG_FAULT
from worker.kinds.batch_predict import run_batch_predict_job
from worker.kinds.evaluate import run_evaluate_job
from worker.kinds.export import run_export_job
from worker.kinds.train import run_train_job
from worker.runtime.delivery import Delivery
from worker.runtime.job_context import JobContext, JobFailed, JobHandler, StopJob
from worker.runtime.outages import ride_out_outage
from worker.runtime.state import WorkerState
from worker.training.trainer import NonFiniteLoss

log = logging.getLogger(__name__)

# A kind without a handler here fails at once on a worker ("cannot run jobs of kind ...").
HANDLERS: dict[JobKind, JobHandler] = {
    JobKind.train: run_train_job,
    JobKind.export: run_export_job,
    JobKind.evaluate: run_evaluate_job,
    JobKind.batch_predict: run_batch_predict_job,
}
# Failures whose message says it all: no traceback in the log, the message is the job's error.
_KNOWN_FAILURES = (JobFailed, DatasetUnavailable, NonFiniteLoss, CheckpointError, NotFound)


class JobRunner:
    def __init__(self, settings: Settings, device: WorkerDevice, store: JobStore, catalog: DatasetCatalog,
                 state: WorkerState, *, health: DeviceHealth | None = None, instance: str = "",
                 take_out_of_service: Callable[[str], None] | None = None, torch_threads: int | None = None,
                 release_cores: Callable[[], None] | None = None, gangs: GangServices | None = None) -> None:
        self.settings = settings
        # The job runs in a thread of its own on `torch_threads` (the process's default: all the
        # cores), after `release_cores` has taken the /predict forward off them (worker/device/cpu_threads.py).
        self.torch_threads = torch_threads or torch.get_num_threads()
        self.release_cores = release_cores or (lambda: None)
        self.device = device
        self.store = store
        self.catalog = catalog
        self.state = state
        self.health = health or DeviceHealth()
        self.instance = instance
        self.take_out_of_service = take_out_of_service or (lambda reason: self.state.out_of_service.set())
        self.paths = CheckpointPaths(settings.checkpoints_dir)
        # The device slot around every task, and the tasks that are a gang's ranks (worker/gang/member.py).
        self.gang = GangMember(self, *gangs) if gangs is not None else None

    def run(self, job_id: str, token: str, seat: str | None = None) -> None:
        """One delivered task: a job on this device, or (`seat`) one rank of a data-parallel job."""
        if self.gang is None:
            self.run_delivery(job_id, token)
        elif seat is not None:
            self.gang.run(job_id, token, seat)
        elif self.gang.take_device(job_id, token):  # else reserved for a gang's rank: its message was re-sent
            try:
                self.run_delivery(job_id, token)
            finally:
                self.gang.release_device(job_id, token)

    def run_delivery(self, job_id: str, token: str, handler: JobHandler | None = None) -> None:
        """Claim the delivery and run `handler` (the kind's, by default) in a thread of its own."""
        if self.state.out_of_service.is_set():
            # Left queued: its dispatch intent stands, and the reconciler re-sends it to another worker.
            log.warning("job %s not started: this worker's device is out of service", job_id)
            return
        try:
            claim = ride_out_outage(
                lambda: self.store.claim(job_id, token, worker=self.device.worker_name, device_id=self.device.id,
                                         instance=self.instance),
                halted=self.state.shutdown.is_set, what=f"the claim of job {job_id}")
        except OUTAGE_ERRORS:
            log.warning("job %s not claimed: Redis is unavailable and this worker is shutting down", job_id)
            return
        if not claim.run:
            log.info("job %s not started: %s", job_id, claim.reason)
            return
        self.state.begin(job_id, token)
        delivery = Delivery(self.store, self.paths, job_id, token, halted=self.state.shutdown.is_set)
        try:
            self.release_cores()
            run_in_own_thread(lambda: self._execute(delivery, handler), self.torch_threads, f"torchyard-job-{job_id}")
        except OUTAGE_ERRORS as exc:  # only while shutting down: the calls wait out an outage otherwise
            log.warning("job %s: Redis is unavailable while this worker shuts down (%s); its lease will lapse "
                        "and another worker resumes it", job_id, exc)
        finally:
            self.state.end()

    def _execute(self, delivery: Delivery, handler: JobHandler | None = None) -> None:
        try:
            self._run_and_finish(delivery, handler)
        finally:
            self._nudge_sweep(delivery.job_id)
            self._release_held()

    def _release_held(self) -> None:
        """A job's end frees a place: start the jobs held for their project's quota that fit now
        (core/access/holds.py); the sweep does it too, so an outage here loses nothing."""
        try:
            self.store.release_held()
        except OUTAGE_ERRORS:
            pass

    def _nudge_sweep(self, job_id: str) -> None:
        """A sweep's trial ended here: wake an API process to tell it and ask the next (core/sweeps/)."""
        try:
            sweep_id = self.store.raw_field(job_id, "sweep_id")
            if sweep_id:
                nudge(self.store.redis, sweep_id)
        except OUTAGE_ERRORS:
            pass  # the API's tick finds it anyway

    def _run_and_finish(self, delivery: Delivery, handler: JobHandler | None = None) -> None:
        job_id = delivery.job_id
        try:
            job = delivery.call(self.store.get, job_id)
            if self.settings.mlflow_tracking_uri and job.kind in (JobKind.train, JobKind.evaluate):
                # Its MLflow run is the tracking thread's (worker/tracking/): one ZADD here, nothing in the loop.
                delivery.call(tracking.enlist, self.store.redis, job_id)
            handler = handler or HANDLERS.get(job.kind)
            if handler is None:
                raise JobFailed(f"this worker cannot run jobs of kind {job.kind!r}")
            ctx = JobContext(job_id, delivery.token, self.settings, self.device, self.store, self.catalog,
                             self.paths, delivery, lambda: self._stop_reason(delivery), delivery)
            outcome = handler(job, ctx)
        except StopJob as stop:
            self._stopped(delivery, stop.reason)
            return
        except NotOwner:
            self._stopped(delivery, "lease_lost")
            return
        except OUTAGE_ERRORS:
            raise
        except Exception as exc:
            self._failed(delivery, exc)
            return
        checkpoint = outcome.checkpoint.model_dump() if outcome.checkpoint else None
        if not delivery.finish(JobStatus.succeeded, checkpoint=checkpoint):
            log.warning("job %s: finished, but another delivery owns the job now; this result is discarded", job_id)

    def _stop_reason(self, delivery: Delivery) -> str | None:
        """Checked every step: local flags first, then one HMGET (job status, delivery token and
        cancel flag; ~0.1 ms, and a GPU step runs ahead asynchronously, so it overlaps its kernels)."""
        if self.state.out_of_service.is_set():
            return "device_broken"
        if self.state.shutdown.is_set():
            return "shutdown"
        if self.state.lease_lost.is_set():
            return "lease_lost"
        self.health.inject_fault()
        return delivery.stop_reason()

    def _stopped(self, delivery: Delivery, reason: str) -> None:
        if reason == "cancelled":
            delivery.finish(JobStatus.cancelled)
        elif reason == "shutdown":
            delivery.requeue(f"worker {self.device.worker_name} shut down")
        elif reason == "device_broken":
            delivery.requeue(f"device {self.device.id} went out of service ({self.health.broken})")
        elif reason.startswith(GANG_FAULT):  # another rank of the gang died, froze or left
            delivery.requeue(reason.partition(": ")[2] or "a rank left the gang")
        else:
            log.warning("job %s: this worker lost its lease; another delivery owns the job now", delivery.job_id)
            delivery.discard_outputs()

    def _failed(self, delivery: Delivery, exc: Exception) -> None:
        job_id = delivery.job_id
        broken = self.health.job_failed(exc)
        if broken:
            # Not the job's fault: give it back (counted as an attempt, so a job that breaks every
            # device it touches still ends), then stop taking jobs and let a fresh process start.
            log.error("job %s hit a sticky device error on %s: %s", job_id, self.device.id, broken)
            self.state.out_of_service.set()
            delivery.requeue(f"device {self.device.id} went out of service ({broken})")
            self.take_out_of_service(broken)
            return
        if isinstance(exc, torch.OutOfMemoryError):
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            error = f"out of memory on {self.device.id}: lower batch_size or image_size ({exc})"
        elif isinstance(exc, _KNOWN_FAILURES):
            error = str(exc)
        else:
            log.exception("job %s failed", job_id)
            error = f"{type(exc).__name__}: {exc}"
        log.warning("job %s failed: %s", job_id, error)
        delivery.finish(JobStatus.failed, error=error[:2000])
