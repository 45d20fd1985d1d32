"""Projects' quotas: what an admin sets (PUT /projects/{name}), what a project uses now, and the
checks that refuse past a quota with a 429 naming it and its value.

Enforced here (and `predict_per_second` by the API's gate, app/api/access.PredictRate, on the
prediction routes before their bodies: a counter per project and second in Redis): `queued_jobs` (a job is refused at creation while its project has that many queued:
waiting helps, so the 429 carries Retry-After) and `dataset_bytes` (an upload whose archive would
take the project's uploads past it: waiting does not help, no Retry-After). Both are exact: each
is judged inside the transaction that writes (the job store's create, core/jobs/intake.py, and
the catalog's record of an upload, core/datasets.py), which WATCHes what the judgement read (the
quota, the queued jobs' index, the datasets' index), so of N requests at once at a quota of q
exactly q pass; `dataset_bytes` is also checked before the archive is extracted, to refuse
early. Usage is read from the records themselves (the queued and running jobs' index, the
datasets' records), so it cannot drift from what exists, and no counter needs giving back.

`running_jobs`, `devices_held` and `device_seconds_per_day` hold a job's start instead of refusing
it (core/access/holds.py: checked in the claim's own transaction, exact); only a project that
has used its device-seconds of the UTC day is refused new jobs here too, with Retry-After = the
seconds to the next UTC day, since none of them could start before then.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import redis

from core import keys
from core.access import holds
from core.access.models import ProjectView, Quota, Usage
from core.access.projects import project_of
from core.clock import redis_now
from core.errors import OverQuota

QUEUED_RETRY_S = 30  # a queued job's place frees when some job of the project starts or ends


class Quotas:
    def __init__(self, client: redis.Redis) -> None:
        self.redis = client

    def get(self, project: str) -> Quota:
        raw = self.redis.get(keys.project_quota(project))
        return Quota.model_validate_json(raw) if raw else Quota()

    def set(self, project: str, quota: Quota) -> Quota:
        self.redis.set(keys.project_quota(project), quota.model_dump_json())
        return quota

    def view(self, project: str) -> ProjectView:
        return ProjectView(name=project, quota=self.get(project), usage=self.usage(project))

    def usage(self, project: str) -> Usage:
        queued, running = (self._jobs_of(project, status) for status in ("queued", "running"))
        uploads = self._uploads_of(project)
        held = holds.usage(self.redis, project, redis_now(self.redis))
        parked = self.redis.zrange(keys.QUOTA_HELD, 0, -1)
        return Usage(queued_jobs=queued, running_jobs=running, datasets=len(uploads), dataset_bytes=sum(uploads),
                     devices_held=int(held["devices_held"]),
                     device_seconds_today=round(held["device_seconds_per_day"], 1),
                     held_jobs=sum(1 for p in self._fields(parked, keys.job, "project") if project_of(p) == project))

    # ------------------------------------------------------------------ checks
    def admission_keys(self, project: str) -> list[str]:
        """What a job's creation WATCHes before `admit_job` (core/jobs/records.Admission): the quota,
        and the queued jobs' index when `queued_jobs` is set (any job that enters or leaves queued
        meanwhile makes the creation judge again; a project without the quota does not wait on it)."""
        watched = [keys.project_quota(project)]
        if self.get(project).queued_jobs is not None:
            watched.append(keys.jobs_with_status("queued"))
        return watched

    def admit_job(self, project: str) -> None:
        """OverQuota when `project` has its `queued_jobs` quota of jobs queued already, or has used
        its `device_seconds_per_day` of this UTC day (Retry-After: the seconds to the next day)."""
        quota = self.get(project)
        limit = quota.queued_jobs
        if limit is not None and self._jobs_of(project, "queued") >= limit:
            raise OverQuota(f"project {project!r} is at its quota of queued_jobs = {limit}: submit again once one "
                            f"of its jobs has started or ended", retry_after_s=QUEUED_RETRY_S)
        daily = quota.device_seconds_per_day
        if daily is not None:
            now = redis_now(self.redis)
            used = holds.usage(self.redis, project, now)["device_seconds_per_day"]
            if used >= daily:
                raise OverQuota(f"project {project!r} used its quota of device_seconds_per_day = {daily} for "
                                f"{holds.utc_day(now)} (UTC, {used:.0f} used): submit again when the next UTC day "
                                f"begins", retry_after_s=holds.seconds_to_next_day(now))

    def admit_upload(self, project: str, size: int) -> None:
        """OverQuota when an archive of `size` bytes would take `project` past `dataset_bytes`."""
        limit = self.get(project).dataset_bytes
        if limit is None:
            return
        used = sum(self._uploads_of(project))
        if used + size > limit:
            raise OverQuota(f"project {project!r} is at its quota of dataset_bytes = {limit}: its uploads hold "
                            f"{used} bytes and this one is {size}; delete one of its datasets first")

    # ------------------------------------------------------------------ usage, read from the records
    def _jobs_of(self, project: str, status: str) -> int:
        ids = self.redis.zrange(keys.jobs_with_status(status), 0, -1)
        return sum(1 for p in self._fields(ids, keys.job, "project") if project_of(p) == project)

    def _uploads_of(self, project: str) -> list[int]:
        import json

        ids = sorted(self.redis.smembers(keys.DATASETS_INDEX))
        raws = self.redis.mget([keys.dataset(i) for i in ids]) if ids else []
        records = [json.loads(r) for r in raws if r]
        return [int(r.get("size_bytes") or 0) for r in records if (r.get("project") or "default") == project]

    def _fields(self, ids: Iterable[str], key: Callable[[str], str], field: str) -> list[str | None]:
        pipe = self.redis.pipeline(transaction=False)
        for item in ids:
            pipe.hget(key(item), field)
        return list(pipe.execute())
