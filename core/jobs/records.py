"""How a job is stored: its id and delivery tokens, the encoding of its Redis hash, and the base
that every part of the job store shares (the connection, the settings, reading one record, and
the two writes each transition makes: the status indexes and the event stream).

Kept apart from the transitions so that each part of the store (core/jobs/__init__.py has the
map) reads and writes records the same way, and a field added by a job kind is decoded once."""

from __future__ import annotations

import json
import logging
import secrets
import time
from typing import Any, Protocol

import redis

from core import keys
from core.access.projects import project_of, visible
from core.errors import NotFound
from core.queue import Dispatch, TrainDelivery
from core.schemas import Job, JobStatus
from core.storage import validate_id

log = logging.getLogger(__name__)

EVENTS_MAXLEN = 5000

# Fields stored as JSON in the job's hash; a kind that records a structured field of its own adds
# its name here so readers decode it (worker/runtime/job_context.py).
JSON_FIELDS = ("params", "device_choices", "progress", "metrics", "checkpoint", "classes", "evaluation", "results",
               "resume_at", "ranks", "mlflow")


def new_job_id() -> str:
    """Time-ordered (lexicographic = chronological), so lists page by id."""
    return f"{time.time_ns() // 1000:014x}{secrets.token_hex(5)}"


def new_token() -> str:
    return secrets.token_hex(8)


def job_id_floor(unix_s: float) -> str:
    """Every job id created before `unix_s` sorts below this (the ids' time prefix, see new_job_id)."""
    return f"{int(unix_s * 1_000_000):014x}"


class NotOwner(Exception):
    """A fenced write was refused: this delivery's token is no longer the job's, or the job is
    no longer running. Nothing was written; the delivery must stop (another one owns the job)."""


def decode_record(raw: dict[str, str]) -> dict[str, Any]:
    """A job's hash as `core.schemas.Job` validates it: JSON fields parsed, empty fields None."""
    doc: dict[str, Any] = dict(raw)
    for field in JSON_FIELDS:
        if field in doc:
            doc[field] = json.loads(doc[field])
    doc["attempts"] = int(doc.get("attempts", 0))
    if doc.get("resumed_from_epoch"):
        doc["resumed_from_epoch"] = int(doc["resumed_from_epoch"])
    for field in ("device", "error", "message", "started_at", "finished_at"):
        doc[field] = doc.get(field) or None
    return doc


def encode_field(field: str, value: Any) -> str:
    """A hash field's stored form: JSON for structured fields, the plain string otherwise."""
    if field in JSON_FIELDS or not isinstance(value, str | int | float):
        return json.dumps(value)
    return str(value)


class Admission(Protocol):
    """A project's quota check at a job's creation (core/access/quotas.Quotas has it): the keys
    create's transaction WATCHes before it asks, so the answer holds when the job is written."""

    def admission_keys(self, project: str) -> list[str]: ...

    def admit_job(self, project: str) -> None: ...


class JobStoreBase:
    """What every part of the job store shares. Not used alone: `core.jobs.JobStore` is."""

    def __init__(self, client: redis.Redis, dispatch: Dispatch | None = None, *,
                 lease_ttl_s: float = 20.0, max_attempts: int = 3, dispatch_grace_s: float | None = None) -> None:
        self.redis = client
        self._dispatch = dispatch
        self.lease_ttl_s = lease_ttl_s
        self.max_attempts = max_attempts
        # How long a sent message may go unclaimed before the reconciler looks for it: about a
        # lease TTL, so a lost message is re-sent within about a lease TTL.
        self.dispatch_grace_s = lease_ttl_s if dispatch_grace_s is None else dispatch_grace_s
        # A project's quota check inside a job's creation (core/access/quotas.py; the API sets it:
        # OverQuota refuses); None: none (a worker's store, a test's).
        self.admission: Admission | None = None

    def get(self, job_id: str) -> Job:
        return Job.model_validate(decode_record(self._raw(job_id)))

    def raw_field(self, job_id: str, field: str) -> str | None:
        return self.redis.hget(keys.job(job_id), field)

    def _raw(self, job_id: str) -> dict[str, str]:
        validate_id(job_id, "job id")
        raw = self.redis.hgetall(keys.job(job_id))
        if not raw or not visible(project_of(raw.get("project"))):  # another project's: not there for it
            raise NotFound(f"job {job_id} not found")
        return raw

    def _send(self, delivery: TrainDelivery) -> None:
        """Send a delivery whose intent is recorded: if this fails (Redis went away after the
        transaction, the broker refused), the reconciler re-sends it; the caller goes on."""
        if self._dispatch is None:
            raise RuntimeError("this JobStore cannot dispatch jobs (no dispatcher configured)")
        try:
            self._dispatch(delivery)
        except Exception as exc:
            log.warning("job %s: sending its delivery failed (%s: %s); the dispatch reconciler will re-send it",
                        delivery.job_id, type(exc).__name__, exc)

    @staticmethod
    def _move_index(pipe: redis.client.Pipeline, job_id: str, old: JobStatus, new: JobStatus) -> None:
        pipe.zrem(keys.jobs_with_status(old.value), job_id)
        pipe.zadd(keys.jobs_with_status(new.value), {job_id: 0})

    @staticmethod
    def _event(pipe: redis.client.Pipeline, job_id: str, kind: str, data: dict[str, Any]) -> None:
        pipe.xadd(keys.job_events(job_id), {"event": kind, "data": json.dumps(data)},
                  maxlen=EVENTS_MAXLEN, approximate=True)
