"""Training jobs: their records in Redis, their transitions, leases, cancellation and dispatch.

This is the one place that knows how a job moves between states. Every transition is a Redis
transaction (WATCH/MULTI) that also appends an event to the job's stream, so the record and
the SSE history never disagree. A running job holds a lease that its worker renews; any
worker's heartbeat sweeps expired leases and redelivers those jobs with a fresh delivery
token, so a stale Celery message (e.g. one Redis restores after its visibility timeout) can
never start a second copy.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import redis

from app.core.errors import Conflict, InvalidInput, NotFound
from app.core.redis import KEY_PREFIX
from app.core.schemas import EpochMetrics, Job, JobList, JobStatus, Progress
from app.core.storage import validate_id

JOBS_INDEX = f"{KEY_PREFIX}jobs"
LEASES = f"{KEY_PREFIX}leases"
EVENTS_MAXLEN = 5000
IDEMPOTENCY_TTL_S = 24 * 3600

TRAIN_QUEUE = "train"


def queue_for_device(requested: str) -> str:
    """Celery queue for a `device` request: shared, per type, or one device's own."""
    if requested == "auto":
        return TRAIN_QUEUE
    if requested in ("cuda", "cpu"):
        return f"{TRAIN_QUEUE}.{requested}"
    return f"{TRAIN_QUEUE}.dev.{requested}"


def now_iso() -> str:
    return datetime.now(UTC).isoformat()


def new_job_id() -> str:
    """Time-ordered (lexicographic = chronological), so lists page by id."""
    return f"{time.time_ns() // 1000:014x}{secrets.token_hex(5)}"


def job_key(job_id: str) -> str:
    return f"{KEY_PREFIX}job:{job_id}"


def events_key(job_id: str) -> str:
    return f"{KEY_PREFIX}job:{job_id}:events"


def status_index(status: JobStatus) -> str:
    return f"{JOBS_INDEX}:status:{status.value}"


# Dispatch is a callable so the core never imports Celery's task code: (job_id, token, queue).
Dispatch = Callable[[str, str, str], None]


@dataclass(frozen=True)
class Claim:
    """The outcome of a worker's attempt to start a delivered job."""

    run: bool
    reason: str = ""
    attempt: int = 0
    resume: bool = False


_JSON_FIELDS = ("params", "progress", "metrics", "checkpoint", "classes")


def _decode(raw: dict[str, str]) -> dict[str, Any]:
    doc: dict[str, Any] = dict(raw)
    for field in _JSON_FIELDS:
        if field in doc:
            doc[field] = json.loads(doc[field])
    doc["attempts"] = int(doc.get("attempts", 0))
    if doc.get("resumed_from_epoch"):
        doc["resumed_from_epoch"] = int(doc["resumed_from_epoch"])
    for field in ("device", "error", "message", "started_at", "finished_at"):
        doc[field] = doc.get(field) or None
    return doc


class JobStore:
    """Job records in Redis. Synchronous: shared by the API (thread pool) and the workers."""

    def __init__(self, client: redis.Redis, dispatch: Dispatch | None = None, *,
                 lease_ttl_s: float = 20.0, max_attempts: int = 3) -> None:
        self.redis = client
        self._dispatch = dispatch
        self.lease_ttl_s = lease_ttl_s
        self.max_attempts = max_attempts

    # ------------------------------------------------------------------ create and read
    def create(self, *, model: str, dataset: str, params: dict[str, Any], requested_device: str,
               idempotency_key: str | None = None) -> tuple[Job, bool]:
        """Record a queued job and dispatch it. Returns (job, created); a repeated key returns the first."""
        idem_key = f"{KEY_PREFIX}idem:{idempotency_key}" if idempotency_key else None
        job_id = new_job_id()
        if idem_key:
            if len(idempotency_key) > 200:
                raise InvalidInput("Idempotency-Key is longer than 200 characters")
            if not self.redis.set(idem_key, job_id, nx=True, ex=IDEMPOTENCY_TTL_S):
                existing = self.redis.get(idem_key)
                for _ in range(50):  # the first request may still be writing its record
                    if existing and self.redis.exists(job_key(existing)):
                        return self.get(existing), False
                    time.sleep(0.01)
                raise Conflict("a request with this Idempotency-Key is still being processed")
        queue = queue_for_device(requested_device)
        token = secrets.token_hex(8)
        created = now_iso()
        record = {
            "id": job_id, "status": JobStatus.queued.value, "model": model, "dataset": dataset,
            "params": json.dumps(params), "requested_device": requested_device, "queue": queue,
            "progress": json.dumps(Progress(epochs=params.get("epochs", 0)).model_dump()),
            "metrics": "[]", "attempts": 0, "created_at": created, "delivery": token,
            "message": f"waiting for a worker on queue {queue}",
        }
        pipe = self.redis.pipeline()
        pipe.hset(job_key(job_id), mapping=record)
        pipe.zadd(JOBS_INDEX, {job_id: 0})
        pipe.zadd(status_index(JobStatus.queued), {job_id: 0})
        self._event(pipe, job_id, "status", {"status": "queued", "attempts": 0})
        pipe.execute()
        job = self.get(job_id)  # as created: an idle worker may claim it as soon as it is sent
        self._send(job_id, token, queue)
        return job, True

    def get(self, job_id: str) -> Job:
        return Job.model_validate(_decode(self._raw(job_id)))

    def raw_field(self, job_id: str, field: str) -> str | None:
        return self.redis.hget(job_key(job_id), field)

    def list(self, status: JobStatus | None = None, limit: int = 50, cursor: str | None = None) -> JobList:
        """Newest first. The cursor is the last id of the previous page (ids sort by time)."""
        index = status_index(status) if status else JOBS_INDEX
        upper = f"({cursor}" if cursor else "+"
        if cursor:
            validate_id(cursor, "cursor")
        ids = self.redis.zrevrangebylex(index, upper, "-", start=0, num=limit + 1)
        page, more = ids[:limit], len(ids) > limit
        pipe = self.redis.pipeline()
        for job_id in page:
            pipe.hgetall(job_key(job_id))
        jobs = [Job.model_validate(_decode(raw)) for raw in pipe.execute() if raw]
        return JobList(jobs=jobs, next_cursor=page[-1] if more and page else None)

    # ------------------------------------------------------------------ worker side
    def claim(self, job_id: str, token: str, *, worker: str, device_id: str) -> Claim:
        """Start a delivered job if this delivery is the current one and nobody holds it."""
        key = job_key(job_id)
        outcome: list[Claim] = []

        def txn(pipe: redis.client.Pipeline) -> None:
            outcome.clear()
            raw = pipe.hgetall(key)
            if not raw:
                outcome.append(Claim(False, "unknown job"))
                return
            if raw.get("delivery") != token:
                outcome.append(Claim(False, "stale delivery"))
                return
            status = JobStatus(raw["status"])
            if status is not JobStatus.queued:
                outcome.append(Claim(False, f"job is {status.value}"))
                return
            attempt = int(raw.get("attempts", 0)) + 1
            now = now_iso()
            pipe.multi()
            fields = {"status": JobStatus.running.value, "attempts": attempt, "device": device_id,
                      "worker": worker, "message": f"running on {device_id} (attempt {attempt})"}
            if not raw.get("started_at"):
                fields["started_at"] = now
            pipe.hset(key, mapping=fields)
            pipe.zadd(LEASES, {job_id: time.time() + self.lease_ttl_s})
            self._move_index(pipe, job_id, status, JobStatus.running)
            self._event(pipe, job_id, "status", {"status": "running", "device": device_id,
                                                 "worker": worker, "attempts": attempt})
            outcome.append(Claim(True, attempt=attempt, resume=attempt > 1))

        self.redis.transaction(txn, key)
        return outcome[0]

    def renew_lease(self, job_id: str, token: str) -> bool:
        """Extend the lease; False when this delivery no longer owns the job (it must stop)."""
        status, delivery = self.redis.hmget(job_key(job_id), "status", "delivery")
        if status != JobStatus.running.value or delivery != token:
            return False
        self.redis.zadd(LEASES, {job_id: time.time() + self.lease_ttl_s}, xx=True)
        return True

    def cancel_requested(self, job_id: str) -> bool:
        return self.redis.hexists(job_key(job_id), "cancel_requested")

    def set_params(self, job_id: str, params: dict[str, Any]) -> None:
        self.redis.hset(job_key(job_id), "params", json.dumps(params))

    def set_classes(self, job_id: str, classes: list[str]) -> None:
        self.redis.hset(job_key(job_id), "classes", json.dumps(classes))

    def set_resumed(self, job_id: str, epoch: int) -> None:
        """Record that this delivery continues after `epoch` (from the resumable checkpoint)."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(job_key(job_id), mapping={"resumed_from_epoch": epoch,
                                            "message": f"resumed after epoch {epoch}"})
        self._event(pipe, job_id, "resumed", {"epoch": epoch})
        pipe.execute()

    def update_progress(self, job_id: str, progress: Progress) -> None:
        data = progress.model_dump()
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(job_key(job_id), "progress", json.dumps(data))
        self._event(pipe, job_id, "progress", data)
        pipe.execute()

    def record_epoch(self, job_id: str, metrics: EpochMetrics) -> None:
        """Append an epoch's metrics (replacing a re-run of the same epoch after a resume)."""
        key = job_key(job_id)

        def txn(pipe: redis.client.Pipeline) -> None:
            history = json.loads(pipe.hget(key, "metrics") or "[]")
            history = [m for m in history if m["epoch"] != metrics.epoch] + [metrics.model_dump()]
            pipe.multi()
            pipe.hset(key, "metrics", json.dumps(history))
            self._event(pipe, job_id, "metrics", metrics.model_dump())

        self.redis.transaction(txn, key)

    def finish(self, job_id: str, token: str, status: JobStatus, *, error: str | None = None,
               checkpoint: dict[str, Any] | None = None) -> bool:
        """Move this delivery's running job to a terminal state and drop its lease."""
        assert status.terminal
        key = job_key(job_id)
        done: list[bool] = []

        def txn(pipe: redis.client.Pipeline) -> None:
            done.clear()
            current_status, delivery = pipe.hmget(key, "status", "delivery")
            if current_status != JobStatus.running.value or delivery != token:
                done.append(False)
                return
            current = JobStatus(current_status)
            done.append(True)
            pipe.multi()
            fields: dict[str, Any] = {"status": status.value, "finished_at": now_iso(),
                                      "message": _finish_message(status, error)}
            if error:
                fields["error"] = error
            if checkpoint:
                fields["checkpoint"] = json.dumps(checkpoint)
            pipe.hset(key, mapping=fields)
            pipe.zrem(LEASES, job_id)
            self._move_index(pipe, job_id, current, status)
            self._event(pipe, job_id, "status", {"status": status.value, "error": error})

        self.redis.transaction(txn, key)
        return done[0]

    def requeue(self, job_id: str, token: str, reason: str) -> bool:
        """Give this delivery's running job back to its queue (its worker is shutting down)."""
        if self.redis.hget(job_key(job_id), "delivery") != token:
            return False
        return self._redeliver(job_id, reason, only_if_expired=False)

    # ------------------------------------------------------------------ user actions
    def request_cancel(self, job_id: str) -> Job:
        """Cancel: a queued job ends at once; a running one stops at its next step."""
        key = job_key(job_id)

        def txn(pipe: redis.client.Pipeline) -> None:
            raw_status = pipe.hget(key, "status")
            if raw_status is None:
                raise NotFound(f"job {job_id} not found")
            status = JobStatus(raw_status)
            if status.terminal:
                raise Conflict(f"job {job_id} is already {status.value}")
            pipe.multi()
            pipe.hset(key, "cancel_requested", now_iso())
            if status is JobStatus.queued:
                pipe.hset(key, mapping={"status": JobStatus.cancelled.value, "finished_at": now_iso(),
                                        "message": "cancelled before it started"})
                self._move_index(pipe, job_id, status, JobStatus.cancelled)
                self._event(pipe, job_id, "status", {"status": "cancelled"})
            else:
                self._event(pipe, job_id, "cancel_requested", {})

        self.redis.transaction(txn, key)
        return self.get(job_id)

    # ------------------------------------------------------------------ recovery
    def sweep_expired_leases(self) -> list[str]:
        """Redeliver every running job whose worker stopped renewing its lease."""
        expired = self.redis.zrangebyscore(LEASES, "-inf", time.time())
        return [job_id for job_id in expired
                if self._redeliver(job_id, "its worker stopped renewing the lease", only_if_expired=True)]

    def _redeliver(self, job_id: str, reason: str, *, only_if_expired: bool) -> bool:
        key = job_key(job_id)
        decided: list[tuple[str, str] | None] = []

        def txn(pipe: redis.client.Pipeline) -> None:
            decided.clear()
            raw = pipe.hgetall(key)
            expiry = pipe.zscore(LEASES, job_id)
            if not raw or raw.get("status") != JobStatus.running.value:
                pipe.multi()
                pipe.zrem(LEASES, job_id)
                decided.append(None)
                return
            if only_if_expired and (expiry is None or expiry > time.time()):
                decided.append(None)
                return
            attempts = int(raw.get("attempts", 0))
            pipe.multi()
            pipe.zrem(LEASES, job_id)
            if only_if_expired and attempts >= self.max_attempts:
                error = (f"gave up after {attempts} attempts: {reason} each time "
                         f"(last on {raw.get('device')})")
                pipe.hset(key, mapping={"status": JobStatus.failed.value, "error": error,
                                        "finished_at": now_iso(), "message": error})
                self._move_index(pipe, job_id, JobStatus.running, JobStatus.failed)
                self._event(pipe, job_id, "status", {"status": "failed", "error": error})
                decided.append(None)
                return
            token = secrets.token_hex(8)
            pipe.hset(key, mapping={"status": JobStatus.queued.value, "delivery": token,
                                    "message": f"requeued: {reason}; resumes from its last finished epoch"})
            self._move_index(pipe, job_id, JobStatus.running, JobStatus.queued)
            self._event(pipe, job_id, "status", {"status": "queued", "reason": reason,
                                                 "attempts": attempts})
            decided.append((token, raw["queue"]))

        self.redis.transaction(txn, key, LEASES)
        if decided and decided[0]:
            token, queue = decided[0]
            self._send(job_id, token, queue)
            return True
        return False

    # ------------------------------------------------------------------ helpers
    def _raw(self, job_id: str) -> dict[str, str]:
        validate_id(job_id, "job id")
        raw = self.redis.hgetall(job_key(job_id))
        if not raw:
            raise NotFound(f"job {job_id} not found")
        return raw

    def _send(self, job_id: str, token: str, queue: str) -> None:
        if self._dispatch is None:
            raise RuntimeError("this JobStore cannot dispatch jobs (no dispatcher configured)")
        self._dispatch(job_id, token, queue)

    @staticmethod
    def _move_index(pipe: redis.client.Pipeline, job_id: str, old: JobStatus, new: JobStatus) -> None:
        pipe.zrem(status_index(old), job_id)
        pipe.zadd(status_index(new), {job_id: 0})

    @staticmethod
    def _event(pipe: redis.client.Pipeline, job_id: str, kind: str, data: dict[str, Any]) -> None:
        pipe.xadd(events_key(job_id), {"event": kind, "data": json.dumps(data)},
                  maxlen=EVENTS_MAXLEN, approximate=True)


def _finish_message(status: JobStatus, error: str | None) -> str:
    if status is JobStatus.succeeded:
        return "finished"
    if status is JobStatus.cancelled:
        return "cancelled by request"
    return error or "failed"
