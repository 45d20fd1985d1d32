"""One delivered job, start to finish: claim it, train it, and record how it ended."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import torch

from app.core.config import Settings
from app.core.datasets import DatasetCatalog
from app.core.errors import NotFound
from app.core.jobs import JobStore
from app.core.schemas import EpochMetrics, JobStatus, Progress
from app.core.storage import CheckpointPaths, sha256_file
from models.registry import get_model_spec
from worker.checkpoint import CheckpointError
from worker.data import DatasetUnavailable, load_dataset
from worker.device import WorkerDevice
from worker.trainer import NonFiniteLoss, StopTraining, Trainer, plan_training

log = logging.getLogger(__name__)



@dataclass
class WorkerState:
    """What the heartbeat publishes and the loop consults; shared across the worker's threads."""

    current_job: str | None = None
    current_token: str | None = None
    shutdown: threading.Event = field(default_factory=threading.Event)
    lease_lost: threading.Event = field(default_factory=threading.Event)


class StoreReporter:
    def __init__(self, store: JobStore, job_id: str) -> None:
        self.store = store
        self.job_id = job_id

    def progress(self, progress: Progress) -> None:
        self.store.update_progress(self.job_id, progress)

    def resumed(self, epoch: int) -> None:
        self.store.set_resumed(self.job_id, epoch)

    def epoch(self, metrics: EpochMetrics) -> None:
        self.store.record_epoch(self.job_id, metrics)
        log.info("job %s epoch %d: loss %.4f acc %.3f val_acc %s %.0f img/s", self.job_id, metrics.epoch,
                 metrics.train_loss, metrics.train_accuracy, metrics.val_accuracy, metrics.images_per_second)


class JobRunner:
    def __init__(self, settings: Settings, device: WorkerDevice, store: JobStore, catalog: DatasetCatalog,
                 state: WorkerState) -> None:
        self.settings = settings
        self.device = device
        self.store = store
        self.catalog = catalog
        self.state = state
        self.paths = CheckpointPaths(settings.checkpoints_dir)

    def run(self, job_id: str, token: str) -> None:
        claim = self.store.claim(job_id, token, worker=self.device.worker_name, device_id=self.device.id)
        if not claim.run:
            log.info("job %s not started: %s", job_id, claim.reason)
            return
        self.state.lease_lost.clear()
        self.state.current_job, self.state.current_token = job_id, token
        try:
            self._train(job_id, token)
        finally:
            self.state.current_job = self.state.current_token = None

    def _train(self, job_id: str, token: str) -> None:
        try:
            job = self.store.get(job_id)
            spec = get_model_spec(job.model)
            size = job.params.get("image_size") or spec.input.height
            height, width = (size, size) if not spec.input.fixed_size else (spec.input.height, spec.input.width)
            channels = spec.input.channels
            record = self.catalog.get(job.dataset)
            data = load_dataset(record, self.settings, channels, height, width, seed=job.params.get("seed", 0))
            self.store.set_classes(job_id, data.classes)
            device = torch.device(self.device.torch_device)
            plan = plan_training(job_id, job.model, job.params, data, device, channels, height, width)
            self.store.set_params(job_id, {**job.params, **plan.as_params()})
            trainer = Trainer(plan, data, final_path=self.paths.final(job_id), resume_path=self.paths.resume(job_id),
                              reporter=StoreReporter(self.store, job_id), should_stop=lambda: self._stop_reason(job_id))
            result = trainer.run()
        except StopTraining as stop:
            self._stopped(job_id, token, stop.reason)
            return
        except (DatasetUnavailable, NonFiniteLoss, CheckpointError, NotFound) as exc:
            self._fail(job_id, token, str(exc))
            return
        except torch.OutOfMemoryError as exc:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self._fail(job_id, token, f"out of memory on {self.device.id}: lower batch_size or image_size ({exc})"[:2000])
            return
        except Exception as exc:
            log.exception("job %s failed", job_id)
            self._fail(job_id, token, f"{type(exc).__name__}: {exc}"[:2000])
            return
        info = {"url": f"/jobs/{job_id}/checkpoint", "sha256": sha256_file(result.final_path),
                "bytes": result.final_path.stat().st_size}
        self.store.finish(job_id, token, JobStatus.succeeded, checkpoint=info)
        self.paths.resume(job_id).unlink(missing_ok=True)

    def _stop_reason(self, job_id: str) -> str | None:
        if self.state.shutdown.is_set():
            return "shutdown"
        if self.state.lease_lost.is_set():
            return "lease_lost"
        # The contract: the cancel flag in Redis is checked every step (one HEXISTS, ~0.1 ms;
        # a GPU step runs ahead asynchronously, so the round trip overlaps its kernels).
        if self.store.cancel_requested(job_id):
            return "cancelled"
        return None

    def _stopped(self, job_id: str, token: str, reason: str) -> None:
        if reason == "cancelled":
            if self.store.finish(job_id, token, JobStatus.cancelled):
                self.paths.resume(job_id).unlink(missing_ok=True)  # nothing will resume a cancelled job
        elif reason == "shutdown":
            self.store.requeue(job_id, token, f"worker {self.device.worker_name} shut down")
        else:
            log.warning("job %s: this worker lost its lease; another delivery owns the job now", job_id)

    def _fail(self, job_id: str, token: str, error: str) -> None:
        log.warning("job %s failed: %s", job_id, error)
        self.store.finish(job_id, token, JobStatus.failed, error=error)
