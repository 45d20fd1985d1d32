"""Jobs that read another job's checkpoint when they run: a training job started `init_from` it,
its evaluations, its batch predictions and its exports. While such a job is queued or running, the
checkpoint it reads must stay (retention and DELETE /jobs/{id} ask `active_dependent` before
removing a job's files, and the delete's own transaction checks again, core/jobs/listing.py).

A dependent is recorded by the transaction that creates it (`JobStore.create(depends_on=...)`,
core/jobs/intake.py): were it a second step, a crash between the two would leave a job whose
source could be deleted under it.
"""

from __future__ import annotations

from pathlib import Path

from core import keys
from core.errors import Conflict, InvalidInput, NotFound
from core.jobs import JobStore
from core.kind_words import job_phrase
from core.schemas import Job, JobKind, JobStatus
from core.storage import CheckpointPaths

_ACTIVE = (JobStatus.queued.value, JobStatus.running.value)


def active_dependent(store: JobStore, parent_id: str) -> str | None:
    """A queued or running job that will read `parent_id`'s checkpoint, if any. Finished ones are
    dropped from the set as they are met, so it stays as small as what is still waiting."""
    client = store.redis
    children = sorted(client.smembers(keys.job_dependents(parent_id)))
    if not children:
        return None
    pipe = client.pipeline(transaction=False)
    for child in children:
        pipe.hget(keys.job(child), "status")
    statuses = pipe.execute()
    finished = [child for child, status in zip(children, statuses, strict=True) if status not in _ACTIVE]
    if finished:
        client.srem(keys.job_dependents(parent_id), *finished)
    active = [child for child, status in zip(children, statuses, strict=True) if status in _ACTIVE]
    return active[0] if active else None


def trained_source(store: JobStore, paths: CheckpointPaths, job_id: str, purpose: str) -> Job:
    """The training job whose checkpoint a new job will read, or why it cannot: 404 unknown, 422 a
    job of another kind (no model), 409 no checkpoint (yet). `purpose`: "to evaluate", ..."""
    trained = store.get(job_id)
    if trained.kind is not JobKind.train:
        raise InvalidInput(f"job {job_id} is {job_phrase(trained.kind, trained.params)}; only a training job has a "
                           f"model {purpose}")
    if trained.status is not JobStatus.succeeded or not paths.final(job_id).exists():
        raise Conflict(f"job {job_id} has no checkpoint {purpose} (it is {trained.status.value})")
    return trained


def downloadable_checkpoint(store: JobStore, paths: CheckpointPaths, job_id: str) -> tuple[Job, Path]:
    """A training job's checkpoint file for GET /jobs/{id}/checkpoint, or why there is none: 404
    unknown, or a job of another kind (what it is made from is named), 409 queued or running (it
    is written when the job succeeds), 404 a finished job without one."""
    job = store.get(job_id)
    if job.kind is not JobKind.train:
        raise NotFound(f"job {job_id} is {job_phrase(job.kind, job.params)}; only a training job has a checkpoint")
    if not job.status.terminal:
        raise Conflict(f"job {job_id} is still {job.status.value}; its checkpoint is written when it succeeds "
                       f"(follow it: GET /jobs/{job_id}/events)")
    path = paths.final(job_id)
    if job.checkpoint is None:
        raise NotFound(f"job {job_id} has no checkpoint: it {job.status.value} before writing one")
    if not path.exists():
        raise NotFound(f"the checkpoint of job {job_id} is no longer on this server")
    return job, path
