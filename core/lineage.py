"""Jobs that read another job's checkpoint when they run: a training job started `init_from` it,
and its evaluations. While such a job is queued or running, the checkpoint it reads must stay
(retention and DELETE /jobs/{id} ask `active_dependent` before removing a job's files).
"""

from __future__ import annotations

import redis

from core import keys
from core.jobs import JobStore
from core.schemas import JobStatus

_ACTIVE = (JobStatus.queued.value, JobStatus.running.value)


def record_dependent(client: redis.Redis, parent_id: str, child_id: str) -> None:
    client.sadd(keys.job_dependents(parent_id), child_id)


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
