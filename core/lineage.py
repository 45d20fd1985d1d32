"""Jobs that read another job's checkpoint when they run: a training job started `init_from` it,
its evaluations, its batch predictions and its exports. While such a job is queued or running, the
checkpoint it reads must stay (retention and DELETE /jobs/{id} ask `active_dependent` before
removing a job's files, and the delete's own transaction checks again, core/jobs/listing.py).

A dependent is recorded by the transaction that creates it (`JobStore.create(depends_on=...)`,
core/jobs/intake.py): were it a second step, a crash between the two would leave a job whose
source could be deleted under it.
"""

from __future__ import annotations

from core import keys
from core.errors import Conflict, InvalidInput
from core.jobs import JobStore
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
        raise InvalidInput(f"job {job_id} is a {trained.kind.value} job; only a training job has a model {purpose}")
    if trained.status is not JobStatus.succeeded or not paths.final(job_id).exists():
        raise Conflict(f"job {job_id} has no checkpoint {purpose} (it is {trained.status.value})")
    return trained
