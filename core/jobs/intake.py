"""What a user's request does to the job store: create a job (its record, its dispatch intent, its
Idempotency-Key and its place among the dependents of the job whose checkpoint it reads, in one
transaction; the message after it), answer a retry of that request, and cancel a job.

The Idempotency-Key lives here because it is part of creating: it is written with the record and
bound to a digest of the resolved request, so the same request again returns the first job and
another request under the same key is refused."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any, Protocol

import redis

from core import keys
from core.access.projects import home, project_of
from core.clock import redis_now, seconds_from_time_reply, utc_now_iso
from core.errors import Conflict, InvalidInput, NotFound
from core.jobs.records import JobStoreBase, new_job_id, new_token
from core.queue import TrainDelivery, queue_for_device
from core.schemas import Job, JobKind, JobStatus, Progress

IDEMPOTENCY_TTL_S = 24 * 3600
MAX_IDEMPOTENCY_KEY = 200


class JobParams(Protocol):
    """What the store needs of a new job's typed params (core/kinds/params.KindParams has it): its
    kind, the devices it runs on at once (a gang's queue) and the epochs its progress counts."""

    @property
    def kind(self) -> JobKind: ...

    @property
    def gang_size(self) -> int: ...

    @property
    def total_epochs(self) -> int: ...

    def model_dump(self, *, mode: str = "python") -> dict[str, Any]: ...


def request_fingerprint(kind: JobKind, model: str, dataset: str, params: Mapping[str, Any],
                        requested_device: str) -> str:
    """A digest of the resolved request: what an Idempotency-Key is bound to. Taken after every
    default was decided (core/kinds/train/resolution.py), so two bodies that ask for the same job agree."""
    canonical = json.dumps({"kind": kind.value, "model": model, "dataset": dataset, "params": dict(params),
                            "device": requested_device}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def body_digest(kind: JobKind, body: Mapping[str, Any]) -> str:
    """A digest of a request as its client sent it (the validated body, before any default is
    resolved): a retry of it is answered by `JobStore.replay` without checking it again."""
    canonical = json.dumps({"kind": kind.value, "body": dict(body)}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _parse_idempotency(value: str) -> tuple[str, str | None]:
    """(job id, request digest). A first-wave value is a bare job id, bound to no request."""
    try:
        doc = json.loads(value)
    except ValueError:
        return value, None
    if isinstance(doc, dict) and isinstance(doc.get("job"), str):
        return doc["job"], doc.get("request")
    return value, None


class Intake(JobStoreBase):
    """The job store's side of `POST /jobs` (and its kinds' submitters) and of a cancel."""

    def create(self, *, model: str, dataset: str, params: JobParams, requested_device: str,
               idempotency_key: str | None = None, body_digest: str | None = None,
               depends_on: str | None = None, tags: Mapping[str, str] | None = None) -> tuple[Job, bool]:
        """Record a queued job of `params`' kind and dispatch it. Returns (job, created); a repeated key
        returns the first.

        One transaction writes the record, its indexes, its first event, the dispatch intent,
        the Idempotency-Key (with `body_digest`, the request as sent: `replay` answers a retry of
        it before anything is validated again) and, for a job that will read another's checkpoint
        (`depends_on`: init_from, an evaluation, a batch prediction, an export), the job among that
        one's dependents (core/lineage.py): a crash can leave all of them or none, so a job never
        exists whose source a delete does not know it needs. The source is watched, and a source
        deleted since the caller checked it is refused here (NotFound), not given a dependent. The
        project's quotas (`admission`, core/access/quotas.py) are judged inside it too, their keys
        watched: exact under concurrent requests.
        `tags` are written into the record as they are (a sweep's trial: `sweep_id`, `trial`)."""
        if idempotency_key is not None and len(idempotency_key) > MAX_IDEMPOTENCY_KEY:
            raise InvalidInput(f"Idempotency-Key is longer than {MAX_IDEMPOTENCY_KEY} characters")
        # Whose job: a job made from another's checkpoint (an evaluation, an export, a fine-tune) is
        # that one's project's; else the tag's (a sweep's trial), else the request's (core/access/projects.py).
        project = (project_of(self.redis.hget(keys.job(depends_on), "project")) if depends_on
                   else (tags or {}).get("project") or home())
        idem_key = keys.idempotency(idempotency_key, project) if idempotency_key else None
        stored = params.model_dump(mode="json")
        fingerprint = request_fingerprint(params.kind, model, dataset, stored, requested_device)
        queue = queue_for_device(requested_device, params.gang_size)  # a gang's: core/gangs/
        job_id, token = new_job_id(), new_token()
        record = {
            "id": job_id, "kind": params.kind.value, "status": JobStatus.queued.value, "model": model,
            "dataset": dataset, "params": json.dumps(stored), "requested_device": requested_device, "queue": queue,
            "progress": json.dumps(Progress(epochs=params.total_epochs).model_dump()),
            "metrics": "[]", "attempts": 0, "created_at": utc_now_iso(), "delivery": token,
            "message": f"waiting for a worker on queue {queue}", **(tags or {}), "project": project,
        }
        earlier: list[str] = []
        source = keys.job(depends_on) if depends_on else None
        # The quota's keys too (the project's quota, the queued index): a job created by another
        # request between this check and the write aborts the write, and the check is made again,
        # so N requests at once at a quota of q admit exactly q.
        admission = self.admission.admission_keys(project) if self.admission is not None else []
        watched = [key for key in (idem_key, source, *admission) if key]

        def txn(pipe: redis.client.Pipeline) -> None:
            earlier.clear()
            if idem_key:
                existing = pipe.get(idem_key)
                if existing:
                    first_id, first_request = _parse_idempotency(existing)
                    if pipe.exists(keys.job(first_id)):
                        if first_request is not None and first_request != fingerprint:
                            raise InvalidInput(
                                f"Idempotency-Key {idempotency_key!r} was already used for a different request "
                                f"(job {first_id}); send the same body to get that job, or use a new key")
                        earlier.append(first_id)
                        return
            if source and not pipe.exists(source):
                raise NotFound(f"job {depends_on} was deleted while this request was checked; nothing was created")
            if self.admission is not None:  # a retry of a created job was answered above: only a new job counts
                # Its keys as the quota is now (the quota itself watched since the first WATCH), then the judgement.
                pipe.watch(*self.admission.admission_keys(project))
                self.admission.admit_job(project)
            now = seconds_from_time_reply(pipe.time()) if watched else redis_now(self.redis)
            pipe.multi()
            pipe.hset(keys.job(job_id), mapping=record)
            pipe.zadd(keys.JOBS_INDEX, {job_id: 0})
            pipe.zadd(keys.jobs_with_status(JobStatus.queued.value), {job_id: 0})
            pipe.zadd(keys.DISPATCH_DUE, {job_id: now + self.dispatch_grace_s})
            if idem_key:
                pipe.set(idem_key, json.dumps({"job": job_id, "request": fingerprint, "body": body_digest}),
                         ex=IDEMPOTENCY_TTL_S)
            if depends_on:
                pipe.sadd(keys.job_dependents(depends_on), job_id)
            self._event(pipe, job_id, "status", {"status": "queued", "attempts": 0})

        if watched:
            self.redis.transaction(txn, *watched)
        else:
            pipe = self.redis.pipeline(transaction=True)
            txn(pipe)
            pipe.execute()
        if earlier:
            return self.get(earlier[0]), False
        job = self.get(job_id)  # as created: an idle worker may claim it as soon as it is sent
        self._send(TrainDelivery(job_id, token, queue))
        return job, True

    def replay(self, idempotency_key: str | None, body_digest: str) -> Job | None:
        """The job an earlier request with this key and this very body created, if it still exists.

        Looked up before the request is validated again: a retry must get its job even after what
        the first request was checked against changed (its dataset deleted, its parent job gone)."""
        if not idempotency_key or len(idempotency_key) > MAX_IDEMPOTENCY_KEY:
            return None
        raw = self.redis.get(keys.idempotency(idempotency_key, home()))
        try:
            doc = json.loads(raw) if raw else None
        except ValueError:
            return None
        if not isinstance(doc, dict) or doc.get("body") != body_digest or not isinstance(doc.get("job"), str):
            return None
        try:
            return self.get(doc["job"])
        except NotFound:
            return None

    def request_cancel(self, job_id: str) -> Job:
        """Cancel: a queued job ends at once; a running one stops at its next step."""
        key = keys.job(job_id)
        self.get(job_id)  # 404 for a job of another project (core/access/projects.py)

        def txn(pipe: redis.client.Pipeline) -> None:
            raw_status = pipe.hget(key, "status")
            if raw_status is None:
                raise NotFound(f"job {job_id} not found")
            status = JobStatus(raw_status)
            if status.terminal:
                raise Conflict(f"job {job_id} is already {status.value}")
            now = seconds_from_time_reply(pipe.time())
            pipe.multi()
            pipe.hset(key, "cancel_requested", utc_now_iso())
            if status is JobStatus.queued:
                pipe.hset(key, mapping={"status": JobStatus.cancelled.value, "finished_at": utc_now_iso(),
                                        "message": "cancelled before it started",
                                        "settle": json.dumps({"token": "", "promote": []})})
                pipe.zrem(keys.DISPATCH_DUE, job_id)
                # An earlier delivery may have left resume states behind: a worker cleans them.
                pipe.zadd(keys.FILES_TO_SETTLE, {job_id: now})
                self._move_index(pipe, job_id, status, JobStatus.cancelled)
                self._event(pipe, job_id, "status", {"status": "cancelled"})
            else:
                self._event(pipe, job_id, "cancel_requested", {})

        self.redis.transaction(txn, key)
        return self.get(job_id)
