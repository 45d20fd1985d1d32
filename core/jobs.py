"""Training jobs: their records in Redis, their transitions, leases, cancellation and dispatch.

This is the one place that knows how a job moves between states. Every transition is a Redis
transaction (WATCH/MULTI, or one Lua script) that also appends an event to the job's stream, so
the record and the SSE history never disagree.

The promise: a job that was accepted runs to completion exactly once, unless cancelled, whatever
dies meanwhile. How each part of it is kept (docs/reliability.md has the faults and the tests):

- **Delivery tokens and fencing.** Each delivery of a job carries a fresh token; only the current
  token of a `queued` job can claim it. Every write a worker makes (progress, metrics, params,
  classes, resumed, finish, requeue) checks, inside the same script or transaction, that its
  token is still the job's and the job is `running`; otherwise nothing is written and
  `NotOwner` is raised. A stale delivery (a frozen worker, a message Redis restored) can change
  nothing a user sees. Its files are its own too (core/storage.CheckpointPaths).
- **The dispatch outbox.** The record and the intent to dispatch (`ty:dispatch`, due one
  `dispatch_grace_s` later on Redis's clock) are written in one transaction; the message is sent
  after it. Claiming removes the intent. Any worker's sweep (`reconcile_dispatch`) re-sends the
  same delivery of a queued job that is overdue and whose message is not waiting in its queue:
  a process that died between record and message, a send or a claim that raised, a message a
  dead worker had taken. A job waiting behind busy workers is left alone (its message is in the
  list), so the reconciler never floods a queue; a duplicate message is dropped at claim.
- **Leases on Redis's clock.** A running job's lease expiry is Redis TIME + `lease_ttl_s`; the
  sweep compares it with Redis TIME, so hosts' clocks never matter. An expired lease is
  redelivered with a fresh token; after `max_attempts` deliveries the job fails.
- **Idempotency-Key** is written in the same transaction as the record and bound to a digest of
  the resolved request: the same request again returns the first job; another request under
  the same key is refused.
- **Files are settled after the fact.** `finish` records, with the terminal state, which staged
  files to promote (`ty:settle`); the owner promotes them at once, and any worker's sweep does it
  if the owner died in between.

Writes that a client may retry after a broken connection (core/redis.py) are idempotent: a
claim retried by the same worker instance claims, a finish found already done by the same
token reports success, an epoch already recorded as such is not recorded twice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import redis

from core import keys
from core.clock import redis_now, seconds_from_time_reply, utc_now_iso
from core.errors import Conflict, InvalidInput, NotFound
from core.queue import Dispatch, TrainDelivery, queue_for_device, waiting_task_ids
from core.schemas import EpochMetrics, Job, JobKind, JobList, JobStatus, Progress
from core.storage import validate_id

log = logging.getLogger(__name__)

EVENTS_MAXLEN = 5000
IDEMPOTENCY_TTL_S = 24 * 3600
MAX_IDEMPOTENCY_KEY = 200
# A finished job's files are settled by its owner at once; a sweep does it only after this.
SETTLE_GRACE_S = 10.0
# Overdue dispatches and unsettled jobs looked at per sweep.
RECOVERY_BATCH = 200


def new_job_id() -> str:
    """Time-ordered (lexicographic = chronological), so lists page by id."""
    return f"{time.time_ns() // 1000:014x}{secrets.token_hex(5)}"


def new_token() -> str:
    return secrets.token_hex(8)


class NotOwner(Exception):
    """A fenced write was refused: this delivery's token is no longer the job's, or the job is
    no longer running. Nothing was written; the delivery must stop (another one owns the job)."""


def job_id_floor(unix_s: float) -> str:
    """Every job id created before `unix_s` sorts below this (the ids' time prefix, see new_job_id)."""
    return f"{int(unix_s * 1_000_000):014x}"


@dataclass(frozen=True)
class Claim:
    """The outcome of a worker's attempt to start a delivered job."""

    run: bool
    reason: str = ""
    attempt: int = 0
    resume: bool = False


@dataclass(frozen=True)
class Settlement:
    """Files of an ended job still to settle: promote `promote` from delivery `token`, clean the rest."""

    job_id: str
    token: str
    promote: list[str]


_JSON_FIELDS = ("params", "device_choices", "progress", "metrics", "checkpoint", "classes", "evaluation", "results",
                "resume_at", "ranks")

# Apply field writes and an event only while `ARGV[1]` is the job's delivery token and the job
# runs. KEYS: job hash, events stream. ARGV: token, events maxlen, event kind ('' for none),
# event data, then field/value pairs.
_FENCED_WRITE = """
local current = redis.call('HMGET', KEYS[1], 'status', 'delivery')
if current[1] ~= 'running' or current[2] ~= ARGV[1] then return 0 end
if #ARGV > 4 then redis.call('HSET', KEYS[1], unpack(ARGV, 5)) end
if ARGV[3] ~= '' then
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'event', ARGV[3], 'data', ARGV[4])
end
return 1
"""

# Extend the lease to Redis TIME + ttl, only for the delivery that owns the running job.
# KEYS: job hash, leases. ARGV: token, ttl seconds, job id.
_RENEW = """
redis.replicate_commands()
local current = redis.call('HMGET', KEYS[1], 'status', 'delivery')
if current[1] ~= 'running' or current[2] ~= ARGV[1] then return 0 end
local now = redis.call('TIME')
local expiry = tonumber(now[1]) + tonumber(now[2]) / 1000000 + tonumber(ARGV[2])
redis.call('ZADD', KEYS[2], string.format('%.6f', expiry), ARGV[3])
return 1
"""

# The reconciler's bookkeeping for one overdue dispatch: drop the intent of a job that is no
# longer queued; postpone it (ARGV[3]) if the job is still queued under the token it saw.
# KEYS: job hash, dispatch zset. ARGV: job id, token seen, next due. 1: still queued as seen.
_POSTPONE_DISPATCH = """
local current = redis.call('HMGET', KEYS[1], 'status', 'delivery')
if current[1] ~= 'queued' then
  redis.call('ZREM', KEYS[2], ARGV[1])
  return 0
end
if current[2] ~= ARGV[2] then return 0 end
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
return 1
"""


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


def _encode(field: str, value: Any) -> str:
    """A hash field's stored form: JSON for structured fields, the plain string otherwise."""
    if field in _JSON_FIELDS or not isinstance(value, str | int | float):
        return json.dumps(value)
    return str(value)


def request_fingerprint(kind: JobKind, model: str, dataset: str, params: Mapping[str, Any],
                        requested_device: str) -> str:
    """A digest of the resolved request: what an Idempotency-Key is bound to. Taken after every
    default was decided (core/params.py), so two bodies that ask for the same job agree."""
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


class JobStore:
    """Job records in Redis. Synchronous: shared by the API (thread pool) and the workers."""

    def __init__(self, client: redis.Redis, dispatch: Dispatch | None = None, *,
                 lease_ttl_s: float = 20.0, max_attempts: int = 3, dispatch_grace_s: float | None = None) -> None:
        self.redis = client
        self._dispatch = dispatch
        self.lease_ttl_s = lease_ttl_s
        self.max_attempts = max_attempts
        # How long a sent message may go unclaimed before the reconciler looks for it: about a
        # lease TTL, so a lost message is re-sent within about a lease TTL.
        self.dispatch_grace_s = lease_ttl_s if dispatch_grace_s is None else dispatch_grace_s
        self._fenced_write = client.register_script(_FENCED_WRITE)
        self._renew = client.register_script(_RENEW)
        self._postpone_dispatch = client.register_script(_POSTPONE_DISPATCH)

    # ------------------------------------------------------------------ create and read
    def create(self, *, model: str, dataset: str, params: dict[str, Any], requested_device: str,
               idempotency_key: str | None = None, kind: JobKind = JobKind.train,
               body_digest: str | None = None) -> tuple[Job, bool]:
        """Record a queued job and dispatch it. Returns (job, created); a repeated key returns the first.

        One transaction writes the record, its indexes, its first event, the dispatch intent
        and the Idempotency-Key (with `body_digest`, the request as sent: `replay` answers a
        retry of it before anything is validated again): a crash can leave all of them or none."""
        if idempotency_key is not None and len(idempotency_key) > MAX_IDEMPOTENCY_KEY:
            raise InvalidInput(f"Idempotency-Key is longer than {MAX_IDEMPOTENCY_KEY} characters")
        idem_key = keys.idempotency(idempotency_key) if idempotency_key else None
        fingerprint = request_fingerprint(kind, model, dataset, params, requested_device)
        queue = queue_for_device(requested_device, int(params.get("world_size") or 1))  # gangs: core/gangs.py
        job_id, token = new_job_id(), new_token()
        record = {
            "id": job_id, "kind": kind.value, "status": JobStatus.queued.value, "model": model, "dataset": dataset,
            "params": json.dumps(params), "requested_device": requested_device, "queue": queue,
            "progress": json.dumps(Progress(epochs=params.get("epochs", 0)).model_dump()),
            "metrics": "[]", "attempts": 0, "created_at": utc_now_iso(), "delivery": token,
            "message": f"waiting for a worker on queue {queue}",
        }
        earlier: list[str] = []

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
            now = seconds_from_time_reply(pipe.time()) if idem_key else redis_now(self.redis)
            pipe.multi()
            pipe.hset(keys.job(job_id), mapping=record)
            pipe.zadd(keys.JOBS_INDEX, {job_id: 0})
            pipe.zadd(keys.jobs_with_status(JobStatus.queued.value), {job_id: 0})
            pipe.zadd(keys.DISPATCH_DUE, {job_id: now + self.dispatch_grace_s})
            if idem_key:
                pipe.set(idem_key, json.dumps({"job": job_id, "request": fingerprint, "body": body_digest}),
                         ex=IDEMPOTENCY_TTL_S)
            self._event(pipe, job_id, "status", {"status": "queued", "attempts": 0})

        if idem_key:
            self.redis.transaction(txn, idem_key)
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
        raw = self.redis.get(keys.idempotency(idempotency_key))
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

    def get(self, job_id: str) -> Job:
        return Job.model_validate(_decode(self._raw(job_id)))

    def raw_field(self, job_id: str, field: str) -> str | None:
        return self.redis.hget(keys.job(job_id), field)

    def page(self, status: JobStatus | None = None, limit: int = 50, cursor: str | None = None) -> JobList:
        """Newest first. The cursor is the last id of the previous page (ids sort by time)."""
        index = keys.jobs_with_status(status.value) if status else keys.JOBS_INDEX
        upper = f"({cursor}" if cursor else "+"
        if cursor:
            validate_id(cursor, "cursor")
        ids = self.redis.zrevrangebylex(index, upper, "-", start=0, num=limit + 1)
        page, more = ids[:limit], len(ids) > limit
        pipe = self.redis.pipeline()
        for job_id in page:
            pipe.hgetall(keys.job(job_id))
        jobs = [Job.model_validate(_decode(raw)) for raw in pipe.execute() if raw]
        return JobList(jobs=jobs, next_cursor=page[-1] if more and page else None)

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

    # ------------------------------------------------------------------ worker side: claim, lease, checks
    def claim(self, job_id: str, token: str, *, worker: str, device_id: str, instance: str = "") -> Claim:
        """Start a delivered job if this delivery is the current one and nobody holds it.

        `instance` names this worker process: a claim it retries after a broken connection
        (the first try did reach Redis) finds the job running under its own token and instance,
        and runs it."""
        key = keys.job(job_id)
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
            attempts = int(raw.get("attempts", 0))
            if status is JobStatus.running and instance and raw.get("claimed_by") == instance:
                outcome.append(Claim(True, attempt=attempts, resume=attempts > 1))
                return
            if status is not JobStatus.queued:
                outcome.append(Claim(False, f"job is {status.value}"))
                return
            attempt = attempts + 1
            now = seconds_from_time_reply(pipe.time())
            pipe.multi()
            fields = {"status": JobStatus.running.value, "attempts": attempt, "device": device_id,
                      "worker": worker, "claimed_by": instance,
                      "message": f"running on {device_id} (attempt {attempt})"}
            if not raw.get("started_at"):
                fields["started_at"] = utc_now_iso()
            pipe.hset(key, mapping=fields)
            pipe.zadd(keys.LEASES, {job_id: now + self.lease_ttl_s})
            pipe.zrem(keys.DISPATCH_DUE, job_id)
            self._move_index(pipe, job_id, status, JobStatus.running)
            self._event(pipe, job_id, "status", {"status": "running", "device": device_id,
                                                 "worker": worker, "attempts": attempt})
            outcome.append(Claim(True, attempt=attempt, resume=attempt > 1))

        self.redis.transaction(txn, key)
        return outcome[0]

    def renew_lease(self, job_id: str, token: str) -> bool:
        """Extend the lease (on Redis's clock); False when this delivery no longer owns the job."""
        return bool(self._renew(keys=[keys.job(job_id), keys.LEASES], args=[token, self.lease_ttl_s, job_id]))

    def stop_reason(self, job_id: str, token: str) -> str | None:
        """Why this delivery must stop now, or None: `lease_lost` when another delivery owns the
        job (or it is no longer running), `cancelled` when a cancel was requested. One HMGET,
        the cost of the cancel check it replaces, so it runs every step."""
        status, delivery, cancel = self.redis.hmget(keys.job(job_id), "status", "delivery", "cancel_requested")
        if status != JobStatus.running.value or delivery != token:
            return "lease_lost"
        return "cancelled" if cancel else None

    # ------------------------------------------------------------------ worker side: fenced writes
    def record(self, job_id: str, token: str, fields: Mapping[str, Any],
               event: tuple[str, dict[str, Any]] | None = None) -> None:
        """Write fields of the job (and append an event) only while `token` owns the running job.

        Values are stored as JSON when the field is a structured one (`_JSON_FIELDS`, which a
        kind adds its own to) or not a str/int/float. Raises NotOwner, writing nothing, otherwise."""
        args: list[Any] = [token, EVENTS_MAXLEN, event[0] if event else "", json.dumps(event[1]) if event else ""]
        for field, value in fields.items():
            args += [field, _encode(field, value)]
        if not self._fenced_write(keys=[keys.job(job_id), keys.job_events(job_id)], args=args):
            raise NotOwner(f"job {job_id}: delivery {token} no longer owns it")

    # --- training outcomes and evaluations (#15): fenced like every write of a delivery ----------
    def notice(self, job_id: str, token: str, kind: str, data: dict[str, Any], message: str) -> None:
        """Something the job's user should know while it runs (a smaller batch after running out of
        memory, early stopping): an event of `kind` and the job's `message`."""
        self.record(job_id, token, {"message": message}, (kind, {**data, "message": message}))

    def set_training_outcome(self, job_id: str, token: str, best_epoch: int | None, stop_reason: str) -> None:
        """Which epoch's weights the checkpoint holds, and why training ended."""
        fields: dict[str, Any] = {"stop_reason": stop_reason}
        if best_epoch is not None:
            fields["best_epoch"] = best_epoch
        self.record(job_id, token, fields)

    def set_evaluation(self, job_id: str, token: str, evaluation: dict[str, Any]) -> None:
        """A checkpoint measured on labelled data (core/schemas.EvaluationResult), and its event."""
        self.record(job_id, token, {"evaluation": evaluation},
                    ("evaluation", {k: evaluation.get(k) for k in ("dataset", "split", "epoch", "accuracy", "loss")}))

    def update_progress(self, job_id: str, token: str, progress: Progress) -> None:
        data = progress.model_dump()
        self.record(job_id, token, {"progress": data}, ("progress", data))

    def set_params(self, job_id: str, token: str, params: dict[str, Any]) -> None:
        self.record(job_id, token, {"params": params})

    def set_classes(self, job_id: str, token: str, classes: list[str]) -> None:
        self.record(job_id, token, {"classes": classes})

    def set_resumed(self, job_id: str, token: str, epoch: int) -> None:
        """Record that this delivery continues after `epoch` (from the resumable checkpoint)."""
        self.record(job_id, token, {"resumed_from_epoch": epoch, "message": f"resumed after epoch {epoch}"},
                    ("resumed", {"epoch": epoch}))

    def record_epoch(self, job_id: str, token: str, metrics: EpochMetrics, resume: str | None = None) -> None:
        """Append an epoch's metrics and, in the same transaction, point the job's resume state at
        `resume` (the file that continues after this epoch): a later delivery resumes exactly
        after the last recorded epoch, so no epoch is ever missing or recorded twice."""
        key = keys.job(job_id)
        entry = metrics.model_dump()

        def txn(pipe: redis.client.Pipeline) -> None:
            status, delivery, raw_history = pipe.hmget(key, "status", "delivery", "metrics")
            if status != JobStatus.running.value or delivery != token:
                raise NotOwner(f"job {job_id}: delivery {token} no longer owns it")
            history = json.loads(raw_history or "[]")
            if entry in history:
                return  # this very record went through already (a retried write)
            history = [m for m in history if m["epoch"] != metrics.epoch] + [entry]
            pipe.multi()
            fields: dict[str, Any] = {"metrics": json.dumps(history)}
            if resume:
                fields["resume"] = resume
            pipe.hset(key, mapping=fields)
            self._event(pipe, job_id, "metrics", entry)

        self.redis.transaction(txn, key)

    def finish(self, job_id: str, token: str, status: JobStatus, *, error: str | None = None,
               checkpoint: dict[str, Any] | None = None, promote: Iterable[str] = ()) -> bool:
        """Move this delivery's running job to a terminal state and drop its lease. True when this
        delivery ended the job (also when a retried call finds it already ended by this token).

        Records, in the same transaction, which of this delivery's staged files a succeeded job
        promotes (`promote`, names in the job's directory) and queues the files to be settled."""
        assert status.terminal
        key = keys.job(job_id)
        done: list[bool] = []
        settle = {"token": token, "promote": list(promote) if status is JobStatus.succeeded else []}

        def txn(pipe: redis.client.Pipeline) -> None:
            done.clear()
            current_status, delivery = pipe.hmget(key, "status", "delivery")
            if delivery != token:
                done.append(False)
                return
            if current_status == status.value:
                done.append(True)  # ended by this very delivery already
                return
            if current_status != JobStatus.running.value:
                done.append(False)
                return
            current = JobStatus(current_status)
            now = seconds_from_time_reply(pipe.time())
            done.append(True)
            pipe.multi()
            fields: dict[str, Any] = {"status": status.value, "finished_at": utc_now_iso(),
                                      "message": _finish_message(status, error), "settle": json.dumps(settle)}
            if error:
                fields["error"] = error
            if checkpoint:
                fields["checkpoint"] = json.dumps(checkpoint)
            pipe.hset(key, mapping=fields)
            pipe.zrem(keys.LEASES, job_id)
            pipe.zadd(keys.FILES_TO_SETTLE, {job_id: now + SETTLE_GRACE_S})
            self._move_index(pipe, job_id, current, status)
            self._event(pipe, job_id, "status", {"status": status.value, "error": error})

        self.redis.transaction(txn, key)
        return done[0]

    def requeue(self, job_id: str, token: str, reason: str) -> bool:
        """Give this delivery's running job back to its queue (its worker is shutting down, or its
        device broke): checked against the token inside the transaction, and bounded like the
        sweep: a job already delivered `max_attempts` times fails instead. True when this call
        requeued or failed the job."""
        return self._back_to_queue(job_id, reason, token=token)

    # ------------------------------------------------------------------ user actions
    def request_cancel(self, job_id: str) -> Job:
        """Cancel: a queued job ends at once; a running one stops at its next step."""
        key = keys.job(job_id)

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

    # ------------------------------------------------------------------ recovery (a worker's sweep)
    def sweep_expired_leases(self, now: float | None = None) -> list[str]:
        """Redeliver every running job whose lease expired by `now` (Redis's clock).

        The caller makes sure `now` is trustworthy: read just before, in a round trip that did not
        stall, by a sweeper that has seen Redis answer for at least a lease TTL (worker/heartbeat.py):
        after an outage nobody could renew, and every lease would look expired."""
        now = redis_now(self.redis) if now is None else now
        expired = self.redis.zrangebyscore(keys.LEASES, "-inf", now)
        swept = [job_id for job_id in expired
                 if self._back_to_queue(job_id, "its worker stopped renewing the lease", expired_by=now)]
        if swept:
            self.redis.hincrby(keys.RECOVERY_STATS, "expired_leases", len(swept))
        return swept

    def take_back_from_dead(self, worker: str, instance: str, is_dead: Callable[[str], bool]) -> list[str]:
        """Requeue at once the running jobs that an earlier process of `worker` (this worker's name:
        the same device on the same host) claimed and that `is_dead` says is gone: a worker
        restarted after a crash resumes its job now, not a lease TTL later. Any other worker's
        jobs, another host's above all, are left to their leases."""
        taken: list[str] = []
        for job_id in self.redis.zrange(keys.jobs_with_status(JobStatus.running.value), 0, -1):
            holder, claimed_by = self.redis.hmget(keys.job(job_id), ["worker", "claimed_by"])
            if holder != worker or not claimed_by or claimed_by == instance or not is_dead(claimed_by):
                continue
            if self._back_to_queue(job_id, f"its worker process ({worker}) died", claimed_by=claimed_by):
                taken.append(job_id)
        if taken:
            self.redis.hincrby(keys.RECOVERY_STATS, "taken_back_after_crash", len(taken))
        return taken

    def reconcile_dispatch(self, now: float | None = None) -> list[str]:
        """Re-send the current delivery of every queued job that is overdue (not claimed within
        `dispatch_grace_s` of being queued) and whose message is not waiting in its queue.

        Bounded and idempotent: a job whose message waits (behind busy workers, or for an offline
        device) is only postponed; a re-sent job is postponed by another grace period, so a job is
        re-sent at most once per `dispatch_grace_s`; the same token is sent again, so if the first
        message turns up after all, the second one finds the job running and is dropped."""
        now = redis_now(self.redis) if now is None else now
        due = self.redis.zrangebyscore(keys.DISPATCH_DUE, "-inf", now, start=0, num=RECOVERY_BATCH)
        if not due:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for job_id in due:
            pipe.hmget(keys.job(job_id), "status", "delivery", "queue")
        states = pipe.execute()
        queued = [(job_id, token, queue) for job_id, (status, token, queue) in zip(due, states, strict=True)
                  if status == JobStatus.queued.value and token and queue]
        waiting = waiting_task_ids(self.redis, {queue for _, _, queue in queued}) if queued else set()
        resent: list[str] = []
        for job_id, (_, token, _) in zip(due, states, strict=True):
            if not self._postpone_dispatch(keys=[keys.job(job_id), keys.DISPATCH_DUE],
                                           args=[job_id, token or "", now + self.dispatch_grace_s]):
                continue  # no longer queued (intent dropped), or requeued meanwhile (its own intent stands)
            delivery = next((TrainDelivery(j, t, q) for j, t, q in queued if j == job_id), None)
            if delivery is not None and delivery.task_id not in waiting:
                self._send(delivery)
                resent.append(job_id)
        if resent:
            self.redis.hincrby(keys.RECOVERY_STATS, "resent_deliveries", len(resent))
            log.warning("re-sent %d queued job(s) whose message was not in their queue: %s", len(resent),
                        ", ".join(resent))
        return resent

    def pending_settlements(self, now: float | None = None) -> list[Settlement]:
        """Ended jobs whose files are overdue to be settled (the owner died before doing it)."""
        now = redis_now(self.redis) if now is None else now
        job_ids = self.redis.zrangebyscore(keys.FILES_TO_SETTLE, "-inf", now, start=0, num=RECOVERY_BATCH)
        if not job_ids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hget(keys.job(job_id), "settle")
        out = []
        for job_id, raw in zip(job_ids, pipe.execute(), strict=True):
            spec: dict[str, Any] = json.loads(raw) if raw else {}
            out.append(Settlement(job_id, str(spec.get("token", "")), list(spec.get("promote", []))))
        return out

    def settled(self, job_id: str) -> None:
        """The job's files are where they belong; forget the settlement."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.hdel(keys.job(job_id), "settle")
        pipe.zrem(keys.FILES_TO_SETTLE, job_id)
        pipe.execute()

    def postpone_settlement(self, job_id: str, seconds: float) -> None:
        self.redis.zadd(keys.FILES_TO_SETTLE, {job_id: redis_now(self.redis) + seconds}, xx=True)

    def recovery_stats(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.redis.hgetall(keys.RECOVERY_STATS).items()}

    def _back_to_queue(self, job_id: str, reason: str, *, token: str | None = None,
                       expired_by: float | None = None, claimed_by: str | None = None) -> bool:
        """Put a running job back to `queued` with a fresh delivery token and a dispatch intent, or
        fail it when it has had `max_attempts` deliveries. Either `token` (the delivery giving the
        job back must still own it), `expired_by` (its lease must have expired by then) or
        `claimed_by` (the worker process that claimed it must still be the one: it died)."""
        key = keys.job(job_id)
        decided: list[tuple[bool, TrainDelivery | None]] = []

        def txn(pipe: redis.client.Pipeline) -> None:
            decided.clear()
            raw = pipe.hgetall(key)
            expiry = pipe.zscore(keys.LEASES, job_id)
            if not raw or raw.get("status") != JobStatus.running.value:
                if expired_by is not None:
                    pipe.multi()
                    pipe.zrem(keys.LEASES, job_id)
                decided.append((False, None))
                return
            if token is not None and raw.get("delivery") != token:
                decided.append((False, None))
                return
            if claimed_by is not None and raw.get("claimed_by") != claimed_by:
                decided.append((False, None))
                return
            if expired_by is not None and (expiry is None or expiry > expired_by):
                decided.append((False, None))
                return
            attempts = int(raw.get("attempts", 0))
            now = seconds_from_time_reply(pipe.time())
            pipe.multi()
            pipe.zrem(keys.LEASES, job_id)
            if attempts >= self.max_attempts:
                error = (f"gave up after {attempts} attempts: {reason} each time "
                         f"(last on {raw.get('device')})")
                # A fresh token: no delivery, the last one included, ends this job a second time.
                pipe.hset(key, mapping={"status": JobStatus.failed.value, "error": error, "delivery": new_token(),
                                        "finished_at": utc_now_iso(), "message": error,
                                        "settle": json.dumps({"token": "", "promote": []})})
                pipe.zadd(keys.FILES_TO_SETTLE, {job_id: now})
                self._move_index(pipe, job_id, JobStatus.running, JobStatus.failed)
                self._event(pipe, job_id, "status", {"status": "failed", "error": error})
                decided.append((True, None))
                return
            fresh = new_token()
            pipe.hset(key, mapping={"status": JobStatus.queued.value, "delivery": fresh,
                                    "message": f"requeued: {reason}; resumes from its last finished epoch"})
            pipe.zadd(keys.DISPATCH_DUE, {job_id: now + self.dispatch_grace_s})
            self._move_index(pipe, job_id, JobStatus.running, JobStatus.queued)
            self._event(pipe, job_id, "status", {"status": "queued", "reason": reason, "attempts": attempts})
            decided.append((True, TrainDelivery(job_id, fresh, raw["queue"])))

        self.redis.transaction(txn, key, keys.LEASES)
        changed, delivery = decided[0] if decided else (False, None)
        if delivery is not None:
            self._send(delivery)
        return changed

    # ------------------------------------------------------------------ retention (#13, core/retention.py)
    def active_jobs(self) -> list[Job]:
        """Every queued or running job: what deletion and cleanup must not pull the ground from under."""
        ids = [job_id for status in (JobStatus.queued, JobStatus.running)
               for job_id in self.redis.zrange(keys.jobs_with_status(status.value), 0, -1)]
        if not ids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hgetall(keys.job(job_id))
        return [Job.model_validate(_decode(raw)) for raw in pipe.execute() if raw]

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
            job = Job.model_validate(_decode(raw))
            if not job.status.terminal:
                raise Conflict(f"job {job_id} is {job.status.value}; cancel it first (POST /jobs/{job_id}/cancel), "
                               f"then delete it")
            # An alias that moved onto this job since the caller's protections ran (core/retention.py)
            # aborts the transaction through the WATCH on the alias index; this catches a move that
            # happened before the WATCH.
            if job_id in pipe.hvals(keys.ALIASES):
                raise Conflict(f"job {job_id} is the target of an alias; move the alias first")
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
        self.redis.transaction(txn, key, keys.ALIASES)
        return found[0]

    # ------------------------------------------------------------------ helpers
    def _raw(self, job_id: str) -> dict[str, str]:
        validate_id(job_id, "job id")
        raw = self.redis.hgetall(keys.job(job_id))
        if not raw:
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


def _finish_message(status: JobStatus, error: str | None) -> str:
    if status is JobStatus.succeeded:
        return "finished"
    if status is JobStatus.cancelled:
        return "cancelled by request"
    return error or "failed"
