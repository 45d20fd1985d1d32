from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, Response
from fastapi.responses import FileResponse
from sse_starlette import EventSourceResponse

from app.api.deps import ServicesDep
from app.api.sse import job_event_response, parse_last_event_id
from core.kinds.batch_predict.spec import BatchPredictSpec
from core.kinds.batch_predict.submit import RESULTS_MEDIA_TYPE, download_name
from core.kinds.evaluate.spec import EvaluateSpec
from core.kinds.request import JobRequest
from core.lineage import downloadable_checkpoint
from core.schemas import Evaluation, Job, JobList, JobStatus
from core.storage import CheckpointPaths

router = APIRouter(tags=["jobs"])


@router.post("/jobs", status_code=202, response_model=Job,
             responses={200: {"description": "An earlier request with this Idempotency-Key", "model": Job},
                        429: {"description": "the project's queued_jobs or device_seconds_per_day quota "
                                             "is reached (Retry-After)"}})
def create_job(services: ServicesDep, spec: JobRequest, response: Response,
               idempotency_key: Annotated[str | None, Header(max_length=200)] = None) -> Job:
    """A training job (`kind` left out or "train"), or a batch-prediction job (`"kind": "predict"`)."""
    if isinstance(spec, BatchPredictSpec):
        job, created = services.batch_predictions.submit(spec, idempotency_key)
    else:
        job, created = services.submission.submit(spec, idempotency_key)
    services.devices.annotate([job])
    services.datasets.annotate([job])
    response.status_code = 202 if created else 200
    response.headers["Location"] = f"/jobs/{job.id}"
    return job


@router.get("/jobs", response_model=JobList)
def list_jobs(services: ServicesDep, status: JobStatus | None = None,
              limit: Annotated[int, Query(ge=1, le=500)] = 50, cursor: str | None = None) -> JobList:
    """Jobs of every kind, newest first, `limit` a page; `next_cursor` gives the next page."""
    page = services.jobs.page(status, limit, cursor)
    services.devices.annotate(page.jobs)
    services.datasets.annotate(page.jobs)
    return page


@router.get("/jobs/{job_id}", response_model=Job, responses={404: {"description": "no such job"}})
def get_job(services: ServicesDep, job_id: str) -> Job:
    """One job: status, params, progress, metrics, checkpoint, and a training job's evaluations."""
    job = services.devices.annotate([services.jobs.get(job_id)])[0]
    services.datasets.annotate([job])
    return services.evaluations.attach(job)


@router.delete("/jobs/{job_id}", status_code=204,
               responses={404: {"description": "no such job"},
                          409: {"description": "queued or running (cancel it first), or kept by a protection"}})
def delete_job(services: ServicesDep, job_id: str) -> Response:
    """A finished job: its record, events, checkpoint and other files, and a training job's exports
    (core/retention.JobDeletion)."""
    services.deletion.delete(job_id)
    return Response(status_code=204)


@router.post("/jobs/{job_id}/cancel", status_code=202, response_model=Job,
             responses={404: {"description": "no such job"}, 409: {"description": "the job has ended already"}})
def cancel_job(services: ServicesDep, job_id: str) -> Job:
    """Stop a running job within one step, or a queued one before it starts; it ends `cancelled`."""
    return services.jobs.request_cancel(job_id)


@router.get("/jobs/{job_id}/events", response_class=EventSourceResponse,
            responses={200: {"content": {"text/event-stream": {}}}, 404: {"description": "no such job"}})
def job_events(services: ServicesDep, job_id: str,
               last_event_id: Annotated[str | None, Header()] = None) -> EventSourceResponse:
    """Server-sent events: the job's history, then each status, progress and metrics update live, ending
    after its terminal status; `Last-Event-ID` resumes after that event."""
    services.jobs.get(job_id)  # 404 before the stream starts
    last_event_id = parse_last_event_id(last_event_id)  # 422 before the stream starts
    return job_event_response(services.aredis, job_id, last_event_id)


@router.get("/jobs/{job_id}/checkpoint", response_class=FileResponse,
            responses={200: {"content": {"application/octet-stream": {}}},
                       404: {"description": "unknown job, a job of another kind, or one that ended without a "
                                            "checkpoint"},
                       409: {"description": "queued or running: the checkpoint is written when it succeeds"}})
def download_checkpoint(services: ServicesDep, job_id: str) -> FileResponse:
    """A succeeded training job's weights, streamed, with their sha256 in `X-Checkpoint-SHA256`."""
    job, path = downloadable_checkpoint(services.jobs, CheckpointPaths(services.settings.checkpoints_dir), job_id)
    assert job.checkpoint is not None
    return FileResponse(path, media_type="application/octet-stream", filename=f"{job.model}-{job_id}.pt",
                        headers={"X-Checkpoint-SHA256": job.checkpoint.sha256})


@router.post("/jobs/{job_id}/evaluate", status_code=202, response_model=Evaluation,
             responses={200: {"description": "An earlier request with this Idempotency-Key", "model": Evaluation},
                        404: {"description": "no such job"},
                        409: {"description": "the job has no checkpoint (it has not succeeded)"},
                        422: {"description": "not a training job, or a dataset that is unknown, unavailable or has "
                                            "classes the model does not"},
                        429: {"description": "the project's queued_jobs or device_seconds_per_day quota "
                                             "is reached (Retry-After)"}})
def evaluate_job(services: ServicesDep, job_id: str, spec: EvaluateSpec, response: Response,
                 idempotency_key: Annotated[str | None, Header(max_length=200)] = None) -> Evaluation:
    """Measure a succeeded training job's checkpoint on a dataset (id or name): an `evaluate` job of its own."""
    evaluation, created = services.evaluations.submit(job_id, spec, idempotency_key)
    response.status_code = 202 if created else 200
    response.headers["Location"] = f"/jobs/{job_id}/evaluations/{evaluation.id}"
    return evaluation


@router.get("/jobs/{job_id}/evaluations/{evaluation_id}", response_model=Evaluation,
            responses={404: {"description": "no such evaluation of this job"}})
def get_evaluation(services: ServicesDep, job_id: str, evaluation_id: str) -> Evaluation:
    """One evaluation of the job: its status and, once it succeeded, accuracy, loss, per-class, confusion."""
    return services.evaluations.get(job_id, evaluation_id)


@router.get("/jobs/{job_id}/results", response_class=FileResponse,
            responses={200: {"content": {RESULTS_MEDIA_TYPE: {}},
                             "description": "One JSON object per line and per image, in the dataset's sorted order"},
                       404: {"description": "no such predict job"}, 409: {"description": "not succeeded (yet)"}})
def download_results(services: ServicesDep, job_id: str) -> FileResponse:
    """A succeeded predict job's results file (core/kinds/batch_predict/submit.py), streamed from disk."""
    job, path = services.batch_predictions.results_file(job_id)
    headers = {"X-Results-SHA256": job.checkpoint.sha256} if job.checkpoint else None
    return FileResponse(path, media_type=RESULTS_MEDIA_TYPE, filename=download_name(job), headers=headers)
