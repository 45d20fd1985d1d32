"""Which export job GET /jobs/{id}/export answers with, against a real Redis: one export job per
(checkpoint sha256, format), reused while it builds and once it is done; a failed one answers its
failure (422, or 501 when the worker lacked the extra) until retry=true builds it again. The worker
side is played through the job store, as a worker's runner drives it."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from core.errors import Conflict, InvalidInput, NotAvailableHere
from core.jobs import JobStore
from core.kinds.export import ExportParams
from core.kinds.export.submit import UNAVAILABLE_PREFIX, ExportCatalog, export_path
from core.schemas import ExportFormat, JobKind, JobStatus
from core.storage import CheckpointPaths
from tests.core.kinds.examples import train_params


@pytest.fixture
def setup(clean_redis_url: str, tmp_path: Path) -> tuple[JobStore, ExportCatalog, list[str]]:
    client = redis.Redis.from_url(clean_redis_url, decode_responses=True)
    sent: list[str] = []
    store = JobStore(client, lambda delivery: sent.append(delivery.job_id))
    return store, ExportCatalog(client, store, CheckpointPaths(tmp_path)), sent


def _run(store: JobStore, job_id: str, status: JobStatus, **finish) -> None:
    token = store.raw_field(job_id, "delivery")
    assert store.claim(job_id, token, worker="w", device_id="n/cpu").run
    if status is not JobStatus.running:
        assert store.finish(job_id, token, status, **finish)


def _trained(store: JobStore, sha: str = "ab" * 32) -> str:
    job, _ = store.create(model="cifar_net", dataset="fake", params=train_params(epochs=1), requested_device="auto")
    _run(store, job.id, JobStatus.succeeded,
         checkpoint={"url": f"/jobs/{job.id}/checkpoint", "sha256": sha, "bytes": 10})
    return job.id


def test_one_export_job_per_checkpoint_and_format(setup) -> None:
    store, catalog, sent = setup
    trained = _trained(store)
    source, export, path = catalog.request(trained, ExportFormat.onnx)
    assert path is None and export.kind is JobKind.export and sent == [trained, export.id]
    assert ExportParams.model_validate(export.params) == ExportParams(
        source_job_id=trained, format=ExportFormat.onnx, checkpoint_sha256=source.checkpoint.sha256)
    assert catalog.request(trained, ExportFormat.onnx)[1].id == export.id  # queued: the same one
    other = catalog.request(trained, ExportFormat.torchscript)[1]
    assert other.id != export.id and len(sent) == 3

    _run(store, export.id, JobStatus.succeeded,
         checkpoint={"url": "/x", "sha256": "cd" * 32, "bytes": 3})
    assert catalog.request(trained, ExportFormat.onnx)[2] is None  # succeeded, but its file is gone: rebuilt
    rebuilt = catalog.request(trained, ExportFormat.onnx)[1]
    assert rebuilt.id != export.id
    _run(store, rebuilt.id, JobStatus.succeeded, checkpoint={"url": "/x", "sha256": "cd" * 32, "bytes": 3})
    file = export_path(catalog.paths, rebuilt.id, ExportFormat.onnx)
    file.parent.mkdir(parents=True)
    file.write_bytes(b"onnx")
    assert catalog.request(trained, ExportFormat.onnx)[2] == file
    assert len(sent) == 4  # nothing more was built


def test_a_failed_export_answers_its_failure_until_retry(setup) -> None:
    store, catalog, sent = setup
    trained = _trained(store)
    export = catalog.request(trained, ExportFormat.onnx)[1]
    _run(store, export.id, JobStatus.failed,
         error=f"{UNAVAILABLE_PREFIX}onnxruntime is not installed on worker cpu@n; install the export extra")
    with pytest.raises(NotAvailableHere, match="onnxruntime is not installed"):
        catalog.request(trained, ExportFormat.onnx)
    again = catalog.request(trained, ExportFormat.onnx, retry=True)[1]
    assert again.id != export.id and sent[-1] == again.id
    _run(store, again.id, JobStatus.failed, error="parity check failed: … differ by up to 0.02 …")
    with pytest.raises(InvalidInput, match=r"differ by up to 0\.02"):
        catalog.request(trained, ExportFormat.onnx)


def test_only_a_succeeded_training_job_is_exported(setup) -> None:
    store, catalog, _ = setup
    running, _ = store.create(model="cifar_net", dataset="fake", params=train_params(epochs=1), requested_device="auto")
    _run(store, running.id, JobStatus.running)
    with pytest.raises(Conflict, match="running"):
        catalog.request(running.id, ExportFormat.torchscript)
    export = catalog.request(_trained(store), ExportFormat.torchscript)[1]
    with pytest.raises(Conflict, match="training job"):
        catalog.request(export.id, ExportFormat.torchscript)
