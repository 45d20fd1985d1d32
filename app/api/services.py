"""Everything the API's routes need, built once per app from its Settings (no import-time I/O)."""

from __future__ import annotations

from dataclasses import dataclass

import redis
import redis.asyncio as aioredis

from app.api.oip.service import OpenInference
from app.api.serving.engine import PredictionClient
from core.access.keystore import KeyStore
from core.access.quotas import Quotas
from core.aliases import AliasService, AliasStore, job_is_aliased
from core.config import Settings
from core.datasets import DatasetCatalog
from core.devices import DeviceRegistry
from core.jobs import JobStore
from core.kinds.batch_predict.submit import BatchPredictions
from core.kinds.evaluate.submit import Evaluations
from core.kinds.export.submit import ExportCatalog
from core.kinds.train.submit import JobSubmission
from core.lineage import active_dependent
from core.preloading import ModelPreloader
from core.queue import create_celery, dispatcher
from core.redis import connect, connect_async
from core.retention import JobDeletion, Retention
from core.schemas import Job
from core.storage import CheckpointPaths
from core.sweeps.coordinator import SweepCoordinator
from core.sweeps.records import SweepRecords


@dataclass
class Services:
    settings: Settings
    redis: redis.Redis
    aredis: aioredis.Redis
    jobs: JobStore
    devices: DeviceRegistry
    datasets: DatasetCatalog
    submission: JobSubmission
    predictions: PredictionClient
    aliases: AliasService
    exports: ExportCatalog
    deletion: JobDeletion
    retention: Retention
    evaluations: Evaluations
    batch_predictions: BatchPredictions
    oip: OpenInference  # the Open Inference Protocol (/v2), on the predictions' engine
    sweeps: SweepCoordinator
    access_keys: KeyStore  # API keys (core/access/); the gate reads their records itself
    quotas: Quotas  # projects' quotas, judged by the job store and the catalog as they create

    @classmethod
    def build(cls, settings: Settings) -> Services:
        url = settings.resolved_redis_url()
        client, aclient = connect(url), connect_async(url, settings.max_connections)
        celery = create_celery(settings)
        jobs = JobStore(client, dispatcher(celery, client), lease_ttl_s=settings.lease_ttl_s,
                        max_attempts=settings.max_attempts, dispatch_grace_s=settings.dispatch_grace_s)
        devices = DeviceRegistry(client, settings.heartbeat_ttl_s)
        datasets = DatasetCatalog(client, settings, jobs)
        quotas = Quotas(client)
        jobs.admission, datasets.admit = quotas, quotas.admit_upload
        predictions = PredictionClient(aclient, settings)
        aliases = AliasService(AliasStore(client), ModelPreloader(client, devices, settings.alias_warm_timeout_s))
        deletion = JobDeletion(jobs, CheckpointPaths(settings.checkpoints_dir))
        deletion.protect(lambda job: _aliased_refusal(client, job))
        deletion.protect(lambda job: _dependent_refusal(jobs, job))
        exports = ExportCatalog(client, jobs, CheckpointPaths(settings.checkpoints_dir))
        deletion.cascade(exports.derived_from)
        return cls(settings, client, aclient, jobs, devices, datasets,
                   JobSubmission(jobs, datasets, devices, settings), predictions, aliases=aliases,
                   exports=exports,
                   deletion=deletion, retention=Retention(settings, client, jobs, datasets, deletion),
                   evaluations=Evaluations(jobs, datasets, devices, settings),
                   batch_predictions=BatchPredictions(jobs, datasets, devices, settings),
                   oip=OpenInference.build(predictions, settings),
                   sweeps=SweepCoordinator(SweepRecords(client), jobs, JobSubmission(jobs, datasets, devices, settings),
                                           devices, url),
                   access_keys=KeyStore(client), quotas=quotas)

    async def close(self) -> None:
        await self.predictions.close()
        await self.aredis.aclose()
        self.redis.close()


def _aliased_refusal(client: redis.Redis, job: Job) -> str | None:
    """The deletion protection of aliases: a job an alias points at stays until it moves."""
    names = job_is_aliased(client, job.id)
    if not names:
        return None
    return (f"job {job.id} is the target of alias(es) {', '.join(names)}; move or delete them first "
            f"(PUT /aliases/{{name}}) and then delete the job")


def _dependent_refusal(jobs: JobStore, job: Job) -> str | None:
    """The deletion protection of lineage: a queued or running job (an init_from child, an
    evaluation) still reads this job's checkpoint."""
    child = active_dependent(jobs, job.id)
    if child is None:
        return None
    return f"job {child} (queued or running) still needs the checkpoint of job {job.id}; wait for it or cancel it"
