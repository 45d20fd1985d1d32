"""What the submitters' tests share: a real Redis and data dir, the job store, dataset catalog and
device registry the API builds, a succeeded cifar_net job on `fake` whose checkpoint is on disk (the
one an evaluation, a batch prediction, an export or an init_from reads), and a small labelled upload
of other classes."""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from core.config import Settings
from core.datasets import DatasetCatalog, DatasetRecord
from core.devices import DeviceRegistry
from core.jobs import JobStore
from core.schemas import JobStatus
from core.storage import CheckpointPaths
from tests.core.kinds.examples import train_params
from tests.datagen import shapes_zip


@dataclass
class World:
    settings: Settings
    store: JobStore
    catalog: DatasetCatalog
    devices: DeviceRegistry
    paths: CheckpointPaths
    trained: str  # a succeeded cifar_net job on `fake`, its checkpoint on disk
    shapes: DatasetRecord  # a labelled upload: circle, square, triangle

    @property
    def parts(self) -> tuple[JobStore, DatasetCatalog, DeviceRegistry, Settings]:
        """What a submitter is built from."""
        return self.store, self.catalog, self.devices, self.settings

    def succeeded(self, job_id: str, classes: list[str], sha: str = "ab" * 32) -> None:
        """`job_id` claimed and finished succeeded with `classes`, its checkpoint written where it is kept."""
        token = self.store.raw_field(job_id, "delivery")
        assert self.store.claim(job_id, token, worker="w", device_id="n/cpu").run
        self.store.set_classes(job_id, token, classes)
        assert self.store.finish(job_id, token, JobStatus.succeeded,
                                 checkpoint={"url": f"/jobs/{job_id}/checkpoint", "sha256": sha, "bytes": 10})
        self.paths.final(job_id).parent.mkdir(parents=True, exist_ok=True)
        self.paths.final(job_id).write_bytes(b"weights")


@pytest.fixture
def world(clean_redis_url: str, tmp_path: Path) -> World:
    settings = Settings(_env_file=None, data_dir=tmp_path, redis_url=clean_redis_url)
    client = redis.Redis.from_url(clean_redis_url, decode_responses=True)
    store = JobStore(client, lambda delivery: None)
    catalog = DatasetCatalog(client, settings, store)
    shapes = catalog.upload(io.BytesIO(shapes_zip(per_class=3, corrupt=None)), "shapes")
    world = World(settings, store, catalog, DeviceRegistry(client, 6.0), CheckpointPaths(settings.checkpoints_dir),
                  "", shapes)
    trained, _ = store.create(model="cifar_net", dataset="fake", params=train_params(epochs=1), requested_device="auto")
    world.succeeded(trained.id, [f"pattern_{k}" for k in range(10)])  # fake's classes
    world.trained = trained.id
    return world
