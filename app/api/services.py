"""Everything the API's routes need, built once per app from its Settings (no import-time I/O)."""

from __future__ import annotations

from dataclasses import dataclass

import redis
import redis.asyncio as aioredis

from app.core.config import Settings
from app.core.datasets import DatasetCatalog
from app.core.devices import DeviceRegistry
from app.core.jobs import JobStore
from app.core.predictions import PredictionClient
from app.core.redis import connect, connect_async
from app.core.training import TrainingService
from worker.celery_app import create_celery, dispatcher


@dataclass
class Services:
    settings: Settings
    redis: redis.Redis
    aredis: aioredis.Redis
    jobs: JobStore
    devices: DeviceRegistry
    datasets: DatasetCatalog
    training: TrainingService
    predictions: PredictionClient

    @classmethod
    def build(cls, settings: Settings) -> Services:
        url = settings.resolved_redis_url()
        client, aclient = connect(url), connect_async(url)
        celery = create_celery(settings)
        jobs = JobStore(client, dispatcher(celery), lease_ttl_s=settings.lease_ttl_s,
                        max_attempts=settings.max_attempts)
        devices = DeviceRegistry(client, settings.heartbeat_ttl_s)
        datasets = DatasetCatalog(client, settings)
        predictions = PredictionClient(aclient, timeout_s=settings.predict_timeout_s,
                                       max_bytes=settings.max_image_bytes, max_pixels=settings.max_image_pixels,
                                       max_images=settings.max_images_per_request)
        return cls(settings, client, aclient, jobs, devices, datasets,
                   TrainingService(jobs, datasets, devices), predictions)

    async def close(self) -> None:
        await self.aredis.aclose()
        self.redis.close()
