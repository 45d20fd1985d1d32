"""Reading many jobs at once, and retiring finished ones: the pages `GET /jobs` lists, the active
jobs that deletion and clean-up must not pull the ground from under, and the scan and delete that
retention (core/retention.py) runs.

Apart from the transitions because none of it moves a job between states: it reads the indexes
the transitions keep, and removes a job only once it has ended."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime

import redis

from core import keys
from core.access.projects import project_of, visible
from core.errors import Conflict, NotFound
from core.jobs.records import JobStoreBase, decode_record, job_id_floor
from core.schemas import Job, JobList, JobStatus
from core.storage import validate_id

# The statuses of a dependent that will still read its source's checkpoint (core/lineage.py).
_READS_A_CHECKPOINT = (JobStatus.queued.value, JobStatus.running.value)


class Listing(JobStoreBase):
    """The job store's reads of many jobs, and its removal of finished ones."""

    def page(self, status: JobStatus | None = None, limit: int = 50, cursor: str | None = None) -> JobList:
        """Newest first. The cursor is the last id of the previous page (ids sort by time)."""
        index = keys.jobs_with_status(status.value) if status else keys.JOBS_INDEX
        if cursor:
            validate_id(cursor, "cursor")
        jobs: list[Job] = []
        # The indexes hold every project's jobs: read in batches past those the request may not
        # see (core/access/projects.py) until the page is full or the index ends.
        while len(jobs) <= limit:
            upper = f"({cursor}" if cursor else "+"
            ids = self.redis.zrevrangebylex(index, upper, "-", start=0, num=max(limit + 1, 100))
            pipe = self.redis.pipeline()
            for job_id in ids:
                pipe.hgetall(keys.job(job_id))
            jobs += [Job.model_validate(decode_record(raw)) for raw in pipe.execute()
                     if raw and visible(project_of(raw.get("project")))]
            if len(ids) < max(limit + 1, 100):
                break
            cursor = ids[-1]
        page, more = jobs[:limit], len(jobs) > limit
        return JobList(jobs=page, next_cursor=page[-1].id if more and page else None)

    def active_job_on_dataset(self, dataset_id: str) -> str | None:
        """A queued or running job that trains on `dataset_id` (its files must stay), if any."""
        for status in (JobStatus.queued, JobStatus.running):
            job_ids = self.redis.zrange(keys.jobs_with_status(status.value), 0, -1)
            if not job_ids:
                continue
            pipe = self.redis.pipeline(transaction=False)
            for job_id in job_ids:
                pipe.hget(keys.job(job_id), "dataset")
            for job_id, dataset in zip(job_ids, pipe.execute(), strict=True):
                if dataset == dataset_id:
                    return str(job_id)
        return None

    # ------------------------------------------------------------------ retention (core/retention.py)
    def active_jobs(self) -> list[Job]:
        """Every queued or running job: what deletion and cleanup must not pull the ground from under."""
        ids = [job_id for status in (JobStatus.queued, JobStatus.running)
               for job_id in self.redis.zrange(keys.jobs_with_status(status.value), 0, -1)]
        if not ids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hgetall(keys.job(job_id))
        return [Job.model_validate(decode_record(raw)) for raw in pipe.execute() if raw]

    def finished_before(self, status: JobStatus, unix_s: float, batch: int = 500) -> Iterator[str]:
        """Ids of jobs in terminal `status` that finished before `unix_s`, oldest first. Only ids
        created before then can qualify (ids sort by creation), so the scan stops at that id."""
        assert status.terminal
        lower, upper = "-", f"({job_id_floor(unix_s)}"
        while ids := self.redis.zrangebylex(keys.jobs_with_status(status.value), lower, upper, start=0, num=batch):
            pipe = self.redis.pipeline(transaction=False)
            for job_id in ids:
                pipe.hget(keys.job(job_id), "finished_at")
            for job_id, finished in zip(ids, pipe.execute(), strict=True):
                if finished and datetime.fromisoformat(finished).timestamp() < unix_s:
                    yield job_id
            lower = f"({ids[-1]}"

    def trim_events(self, job_id: str) -> None:
        """Drop a finished job's event history but its last event (the terminal status), so a client
        that follows it still gets the end of the stream."""
        self.redis.xtrim(keys.job_events(job_id), maxlen=1, approximate=False)

    def delete(self, job_id: str) -> Job:
        """Remove a finished job's record, events and index entries (its files are the caller's,
        core/retention.py). A queued or running job is refused: cancel it first."""
        key = keys.job(job_id)
        found: list[Job] = []

        def txn(pipe: redis.client.Pipeline) -> None:
            found.clear()
            raw = pipe.hgetall(key)
            if not raw:
                raise NotFound(f"job {job_id} not found")
            job = Job.model_validate(decode_record(raw))
            if not job.status.terminal:
                raise Conflict(f"job {job_id} is {job.status.value}; cancel it first (POST /jobs/{job_id}/cancel), "
                               f"then delete it")
            # An alias that moved onto this job since the caller's protections ran (core/retention.py)
            # aborts the transaction through the WATCH on the alias index; this catches a move that
            # happened before the WATCH.
            if job_id in pipe.hvals(keys.ALIASES):
                raise Conflict(f"job {job_id} is the target of an alias; move the alias first")
            # Likewise a job created since that reads this one's checkpoint (it joins the dependents
            # in its own creating transaction, core/jobs/intake.py): the WATCH on the set, and this.
            for child in sorted(pipe.smembers(keys.job_dependents(job_id))):
                if pipe.hget(keys.job(child), "status") in _READS_A_CHECKPOINT:
                    raise Conflict(f"job {child} (queued or running) still needs the checkpoint of job {job_id}; "
                                   f"wait for it or cancel it")
            pipe.multi()
            pipe.delete(key, keys.job_events(job_id), keys.job_dependents(job_id))
            pipe.zrem(keys.JOBS_INDEX, job_id)
            for status in JobStatus:
                pipe.zrem(keys.jobs_with_status(status.value), job_id)
            pipe.zrem(keys.LEASES, job_id)
            pipe.zrem(keys.DISPATCH_DUE, job_id)
            pipe.zrem(keys.FILES_TO_SETTLE, job_id)
            found.append(job)

        validate_id(job_id, "job id")
        self.redis.transaction(txn, key, keys.ALIASES, keys.job_dependents(job_id))
        return found[0]
