"""Evaluations, the API's side: a trained job's checkpoint measured on a dataset, as a job.

`POST /jobs/{id}/evaluate` creates a job of kind `evaluate` (same lifecycle as training: queued →
running → succeeded, leases, redelivery, events) whose params name the trained job; the worker's
handler (worker/kinds/evaluate.py) writes the result into that job's record (`evaluation`). The
trained job lists its evaluations through an index (`ty:job:<id>:evaluations`), so
`GET /jobs/{id}` shows them and `GET /jobs/{id}/evaluations/{eid}` reads one.
"""

from __future__ import annotations

import time

from core import keys
from core.datasets import DatasetRecord, builtin_classes
from core.errors import InvalidInput, NotFound
from core.kinds.evaluate.params import EvaluateParams, resolve
from core.kinds.evaluate.spec import EvaluateSpec
from core.kinds.submitter import Submitter, check_two_classes, unlabeled_message
from core.lineage import trained_source
from core.schemas import Evaluation, Job, JobKind

# GET /jobs/{id} shows this many of a job's evaluations, newest first.
LISTED_EVALUATIONS = 50


class Evaluations(Submitter):
    def submit(self, job_id: str, spec: EvaluateSpec, idempotency_key: str | None = None) -> tuple[Evaluation, bool]:
        """Queue an evaluation of `job_id`'s checkpoint on `spec.dataset`. 404 unknown job, 409 a job
        without a checkpoint (yet), 422 a dataset that is unknown, unavailable or has other classes."""
        digest, earlier = self.replay(JobKind.evaluate, {"job": job_id, **spec.model_dump(mode="json")},
                                      idempotency_key)
        if earlier is not None:  # a retry: its evaluation, whatever changed since it was checked
            return self.view(earlier), False
        trained = trained_source(self.store, self.paths, job_id, "to evaluate")
        dataset = self.catalog.resolve(spec.dataset)
        if not dataset.available:
            raise InvalidInput(f"dataset {dataset.id} is not available: {dataset.description}")
        if not dataset.labeled:
            raise InvalidInput(unlabeled_message(dataset, "evaluate against"))
        check_two_classes(dataset, "an evaluation")
        _check_classes(trained, dataset)
        device = self.devices.validate_request(spec.device)
        job, created = self.store.create(model=trained.model, dataset=dataset.id,
                                         params=resolve(job_id, spec),
                                         requested_device=device, idempotency_key=idempotency_key,
                                         body_digest=digest, depends_on=job_id)
        if created:
            self.store.redis.zadd(keys.job_evaluations(job_id), {job.id: time.time()})
        return self.view(job), created

    def get(self, job_id: str, evaluation_id: str) -> Evaluation:
        job = self.store.get(evaluation_id)
        if job.kind is not JobKind.evaluate or EvaluateParams.of(job).trained_job != job_id:
            raise NotFound(f"job {job_id} has no evaluation {evaluation_id}")
        return self.view(job)

    def list(self, job_id: str, limit: int = LISTED_EVALUATIONS) -> list[Evaluation]:
        ids = self.store.redis.zrevrange(keys.job_evaluations(job_id), 0, limit - 1)
        views = []
        for evaluation_id in ids:
            try:
                views.append(self.view(self.store.get(evaluation_id)))
            except NotFound:  # removed by retention
                self.store.redis.zrem(keys.job_evaluations(job_id), evaluation_id)
        return views

    def attach(self, job: Job) -> Job:
        """A training job with its evaluations (GET /jobs/{id})."""
        if job.kind is JobKind.train:
            job.evaluations = self.list(job.id)
        return job

    def view(self, job: Job) -> Evaluation:
        self.catalog.annotate([job])
        return Evaluation(id=job.id, job_id=EvaluateParams.of(job).trained_job, status=job.status,
                          dataset=job.dataset, dataset_name=job.dataset_name, device=job.device, error=job.error,
                          created_at=job.created_at, finished_at=job.finished_at, result=job.evaluation)


def _check_classes(trained: Job, dataset: DatasetRecord) -> None:
    """Every class of the dataset must be one the model was trained on (matched by name; a dataset
    may lack some of the model's classes, e.g. a test set without one of them)."""
    model_classes = trained.classes or []
    data_classes = dataset.classes or builtin_classes(dataset.id) or []
    unknown = [c for c in data_classes if c not in model_classes]
    if unknown:
        raise InvalidInput(f"dataset {dataset.id} ({dataset.name}) has classes the model of job {trained.id} does "
                           f"not: {', '.join(unknown[:20])}{' …' if len(unknown) > 20 else ''}; the model's classes "
                           f"are {', '.join(model_classes[:50])}")
