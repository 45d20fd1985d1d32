"""Batch predictions, the API's side: a trained job's model over every image of an uploaded dataset,
as a job.

`POST /jobs` with `"kind": "predict"` creates a batch-prediction job (the lifecycle of every
kind: queued → running → succeeded, leases, redelivery, cancel, events); the worker's handler
(worker/kinds/batch_predict.py) writes one JSON line per image into the job's `results.jsonl`, which
`GET /jobs/{id}/results` streams once the job succeeded. This module is the API's side: what a
submission must name (a succeeded training job, directly or through an alias resolved once, here;
an uploaded dataset, labelled or not; a top-k the model can answer) and where the file is.

Why a job and not a long /predict: a folder of 100k images takes minutes, must survive a worker
dying (the handler resumes after its last flushed image) and must not hold an HTTP request; and
reading the images from the worker's disk, decoded beside the forward pass, is what lets it
approach the raw batched forward (bench/batch_predict.py).
"""

from __future__ import annotations

from pathlib import Path

from core.aliases import AliasStore
from core.errors import Conflict, InvalidInput, NotFound
from core.kind_words import job_phrase
from core.kinds.batch_predict.params import resolve
from core.kinds.batch_predict.spec import BatchPredictSpec
from core.kinds.submitter import Submitter
from core.lineage import trained_source
from core.schemas import Job, JobKind, JobStatus
from core.storage import CheckpointPaths

RESULTS_FILE = "results.jsonl"
RESULTS_MEDIA_TYPE = "application/x-ndjson"


class BatchPredictions(Submitter):
    def submit(self, spec: BatchPredictSpec, idempotency_key: str | None = None) -> tuple[Job, bool]:
        """Queue a batch prediction. 404 an unknown job or alias, 409 a training job without a checkpoint
        (yet), 422 a job that is not a training job, a dataset that is unknown or built in, a top_k
        beyond the model's classes, a device nobody could be."""
        digest, earlier = self.replay(JobKind.batch_predict, spec.model_dump(mode="json"), idempotency_key)
        if earlier is not None:  # a retry: its job, whatever changed since it was checked
            return earlier, False
        trained_id = self._trained_job_id(spec)
        trained = trained_source(self.store, self.paths, trained_id, "to predict with")
        classes = trained.classes or []
        if classes and spec.top_k > len(classes):
            raise InvalidInput(f"top_k {spec.top_k} is more than the {len(classes)} classes of job {trained_id}'s "
                               f"model")
        dataset = self.catalog.resolve(spec.dataset)
        if dataset.kind != "upload":
            raise InvalidInput(f"dataset {dataset.id} is built in; batch predictions read an uploaded dataset's "
                               f"files (POST /datasets, labels=none for a folder without classes)")
        dataset = self.catalog.claim_for_job(dataset.id)  # marked as used: not deleted before the job exists
        device = self.devices.validate_request(spec.device)
        params = resolve(trained_id, spec, dataset)
        job, created = self.store.create(model=trained.model, dataset=dataset.id, params=params,
                                         requested_device=device, idempotency_key=idempotency_key,
                                         body_digest=digest,
                                         depends_on=trained_id)  # its checkpoint stays while this runs
        return job, created

    def results_file(self, job_id: str) -> tuple[Job, Path]:
        """The finished results of a batch prediction: 404 unknown (or another kind), 409 not succeeded."""
        job = self.store.get(job_id)
        if job.kind is not JobKind.batch_predict:
            raise NotFound(f"job {job_id} is {job_phrase(job.kind, job.params)}; only batch prediction jobs have results")
        path = results_path(self.paths, job_id)
        if job.status is not JobStatus.succeeded:
            raise Conflict(f"job {job_id} is {job.status.value}; its results are ready when it has succeeded")
        if not path.exists():
            raise NotFound(f"the results of job {job_id} are no longer on this server")
        return job, path

    def _trained_job_id(self, spec: BatchPredictSpec) -> str:
        if spec.alias is not None:
            return AliasStore(self.store.redis).get(spec.alias).job_id  # NotFound: 404
        assert spec.job_id is not None  # BatchPredictSpec wants exactly one of them
        return spec.job_id


def results_path(paths: CheckpointPaths, job_id: str) -> Path:
    """Where a succeeded batch prediction's file is (promoted there from its delivery's directory)."""
    return paths.job_dir(job_id) / RESULTS_FILE


def download_name(job: Job) -> str:
    return f"predictions-{job.id}.jsonl"
