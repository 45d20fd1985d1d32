"""A job that reads another job's checkpoint (init_from, an evaluation, a batch prediction, an export)
is one of that job's dependents from the moment it exists: the record and the dependent are one
transaction, so a delete of the source is refused whenever the dependent job exists, whatever
happened to the process that created it. Against a real Redis."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from core import keys
from core.config import Settings
from core.datasets import DatasetCatalog
from core.devices import DeviceRegistry
from core.errors import Conflict, NotFound
from core.jobs import JobStore
from core.kinds.batch_predict import BatchPredictSpec
from core.kinds.batch_predict.submit import BatchPredictions
from core.kinds.evaluate import EvaluateSpec
from core.kinds.evaluate.submit import Evaluations
from core.kinds.export.submit import ExportCatalog
from core.kinds.train import JobSpec
from core.kinds.train.submit import JobSubmission
from core.lineage import active_dependent
from core.retention import JobDeletion
from core.schemas import ExportFormat, JobKind, JobStatus
from core.storage import CheckpointPaths
from tests.core.kinds.examples import train_params
from tests.datagen import shapes_zip


class GoneAfterCreating(redis.Redis):
    """A connection to the real Redis that answers the transaction creating a job, then reaches
    Redis no more: the API process SIGKILLed, or its connection cut, right after that transaction.
    Whatever its submitter meant to write after it never arrives."""

    gone = False

    def execute_command(self, *args: Any, **options: Any) -> Any:
        if self.gone:
            raise redis.ConnectionError("the submitting process died after the job's transaction")
        return super().execute_command(*args, **options)

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        pipe = super().pipeline(transaction, shard_hint)
        execute = pipe.execute
        queued = keys.jobs_with_status(JobStatus.queued.value)

        def execute_then_die(raise_on_error: bool = True) -> list[Any]:
            if self.gone:
                raise redis.ConnectionError("the submitting process died after the job's transaction")
            creates = any(args[:2] == ("ZADD", queued) for args, _ in pipe.command_stack)
            result = execute(raise_on_error)
            self.gone = self.gone or creates
            return result

        pipe.execute = execute_then_die  # type: ignore[method-assign]
        return pipe


def _store(client: redis.Redis) -> JobStore:
    return JobStore(client, lambda delivery: None)


@pytest.fixture
def source(clean_redis_url: str, tmp_path: Path) -> dict:
    """A succeeded cifar_net job on `fake` with its checkpoint on disk, and an uploaded set to predict on."""
    settings = Settings(data_dir=tmp_path, redis_url=clean_redis_url)
    client = redis.Redis.from_url(clean_redis_url, decode_responses=True)
    store = _store(client)
    job, _ = store.create(model="cifar_net", dataset="fake", params=train_params(epochs=1), requested_device="auto")
    token = store.raw_field(job.id, "delivery")
    assert store.claim(job.id, token, worker="w", device_id="n/cpu").run
    store.set_classes(job.id, token, [f"pattern_{k}" for k in range(10)])  # fake's classes
    assert store.finish(job.id, token, JobStatus.succeeded,
                        checkpoint={"url": f"/jobs/{job.id}/checkpoint", "sha256": "ab" * 32, "bytes": 10})
    paths = CheckpointPaths(settings.checkpoints_dir)
    paths.final(job.id).parent.mkdir(parents=True)
    paths.final(job.id).write_bytes(b"weights")
    upload = DatasetCatalog(client, settings, store).upload(io.BytesIO(shapes_zip(per_class=3, corrupt=None)), "shapes")
    return {"settings": settings, "url": clean_redis_url, "job": job.id, "upload": upload.id, "paths": paths}


def _submitters(job_id: str, upload: str) -> dict[str, Callable[[JobStore, DatasetCatalog, DeviceRegistry, Settings],
                                                                 Any]]:
    return {
        "init_from": lambda store, catalog, devices, settings: JobSubmission(store, catalog, devices, settings).submit(
            JobSpec(model="cifar_net", dataset="fake", epochs=1, init_from=job_id)),
        "evaluate": lambda store, catalog, devices, settings: Evaluations(store, catalog, devices, settings).submit(
            job_id, EvaluateSpec(dataset="fake")),
        "predict": lambda store, catalog, devices, settings: BatchPredictions(store, catalog, devices, settings).submit(
            BatchPredictSpec(kind=JobKind.batch_predict, job_id=job_id, dataset=upload)),
        "export": lambda store, catalog, devices, settings: ExportCatalog(
            store.redis, store, CheckpointPaths(settings.checkpoints_dir)).request(job_id, ExportFormat.onnx),
    }


@pytest.mark.parametrize("kind", ["init_from", "evaluate", "predict", "export"])
def test_a_dependent_whose_submitter_died_after_creating_it_still_keeps_its_source(source: dict, kind: str) -> None:
    """The submitting process is gone the moment the job's transaction is answered (nothing it would
    write next arrives): the job exists, and the delete of the job whose checkpoint it reads is
    refused, by the protection the API asks first and by the delete's own transaction."""
    settings, job_id = source["settings"], source["job"]
    dying = GoneAfterCreating.from_url(source["url"], decode_responses=True)
    store = _store(dying)
    submit = _submitters(job_id, source["upload"])[kind]
    with pytest.raises(redis.ConnectionError):
        submit(store, DatasetCatalog(dying, settings, store), DeviceRegistry(dying, 6.0), settings)

    client = redis.Redis.from_url(source["url"], decode_responses=True)
    survivor = _store(client)
    [child] = [j for j in client.zrange(keys.JOBS_INDEX, 0, -1) if j not in (job_id,)]
    assert survivor.get(child).status is JobStatus.queued  # the dependent exists
    assert active_dependent(survivor, job_id) == child
    with pytest.raises(Conflict, match=child):
        JobDeletion(survivor, source["paths"]).delete(job_id)
    with pytest.raises(Conflict, match=f"job {child} \\(queued or running\\) still needs the checkpoint of job {job_id}"):
        survivor.delete(job_id)  # the delete's own transaction, past the protections
    assert survivor.get(job_id).status is JobStatus.succeeded and source["paths"].final(job_id).exists()

    survivor.request_cancel(child)  # once it has ended, the source may go
    JobDeletion(survivor, source["paths"]).delete(job_id)
    assert not client.exists(keys.job(job_id))


def test_a_source_deleted_before_the_dependents_transaction_is_not_given_one(source: dict) -> None:
    """The submitter checked the source, then it was deleted before the job was created: the create
    watches the source and refuses, instead of creating a job whose checkpoint is gone."""
    client = redis.Redis.from_url(source["url"], decode_responses=True)
    store = _store(client)
    JobDeletion(store, source["paths"]).delete(source["job"])
    with pytest.raises(NotFound, match="was deleted while this request was checked"):
        store.create(model="cifar_net", dataset="fake", params=train_params(epochs=1), requested_device="auto",
                     depends_on=source["job"])
    assert client.zcard(keys.JOBS_INDEX) == 0
