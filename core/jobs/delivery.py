"""What the delivery that owns a running job does with it: claim it, keep its lease, ask whether
to stop, write what it learns (progress, metrics, params, classes, outcomes), and finish it.

Every write here is fenced: it checks, inside the same Lua script or transaction, that the
delivery's token is still the job's and the job is `running`; otherwise nothing is written and
`NotOwner` is raised, so a stale delivery (a frozen worker, a message Redis restored) changes
nothing a user sees. A delivery that ends without finishing gives the job back through
core/jobs/recovery.py."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import redis
from redis.commands.core import Script

from core import keys
from core.access import holds
from core.access.projects import project_of
from core.clock import seconds_from_time_reply, utc_now_iso
from core.jobs.records import EVENTS_MAXLEN, JobStoreBase, NotOwner, encode_field
from core.schemas import EpochMetrics, JobStatus, Progress

# A finished job's files are settled by its owner at once; a sweep does it only after this.
SETTLE_GRACE_S = 10.0


@dataclass(frozen=True)
class Claim:
    """The outcome of a worker's attempt to start a delivered job."""

    run: bool
    reason: str = ""
    attempt: int = 0
    resume: bool = False
    held: bool = False  # not started: its project is at a quota that holds starts (core/access/holds.py)


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


class DeliverySide(JobStoreBase):
    """The job store as the delivery that owns a job uses it (worker/delivery.Delivery, worker/runtime/job_context.py)."""

    @cached_property
    def _fenced_write(self) -> Script:
        return self.redis.register_script(_FENCED_WRITE)

    @cached_property
    def _renew(self) -> Script:
        return self.redis.register_script(_RENEW)

    # ------------------------------------------------------------------ claim, lease, checks
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
            project = project_of(raw.get("project"))
            pipe.watch(keys.project_quota(project))  # an admin's PUT meanwhile: judged again
            limits = holds.read_limits(pipe, project)
            if limits:  # the usage it is judged by must not change before this transaction commits
                pipe.watch(keys.jobs_with_status(JobStatus.running.value),
                           keys.project_device_seconds(project, holds.utc_day(now)))
                reason = holds.hold_reason(limits, holds.usage(pipe, project, now), project,
                                           holds.devices_of(raw), now)
                if reason is not None:
                    pipe.multi()
                    pipe.hset(key, "message", reason)
                    pipe.zrem(keys.DISPATCH_DUE, job_id)  # not the reconciler's: release_held re-sends it
                    pipe.zadd(keys.QUOTA_HELD, {job_id: now})
                    outcome.append(Claim(False, reason, held=True))
                    return
            pipe.multi()
            fields = {"status": JobStatus.running.value, "attempts": attempt, "device": device_id,
                      "worker": worker, "claimed_by": instance, "running_since": f"{now:.6f}",
                      "message": f"running on {device_id} (attempt {attempt})"}
            if not raw.get("started_at"):
                fields["started_at"] = utc_now_iso()
            pipe.hset(key, mapping=fields)
            pipe.zadd(keys.LEASES, {job_id: now + self.lease_ttl_s})
            pipe.zrem(keys.DISPATCH_DUE, job_id)
            pipe.zrem(keys.QUOTA_HELD, job_id)
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

    # ------------------------------------------------------------------ fenced writes
    def record(self, job_id: str, token: str, fields: Mapping[str, Any],
               event: tuple[str, dict[str, Any]] | None = None) -> None:
        """Write fields of the job (and append an event) only while `token` owns the running job.

        Values are stored as JSON when the field is a structured one (`records.JSON_FIELDS`, which a
        kind adds its own to) or not a str/int/float. Raises NotOwner, writing nothing, otherwise."""
        args: list[Any] = [token, EVENTS_MAXLEN, event[0] if event else "", json.dumps(event[1]) if event else ""]
        for field, value in fields.items():
            args += [field, encode_field(field, value)]
        if not self._fenced_write(keys=[keys.job(job_id), keys.job_events(job_id)], args=args):
            raise NotOwner(f"job {job_id}: delivery {token} no longer owns it")

    # --- training outcomes and evaluations: fenced like every write of a delivery ---------------
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
            current_status, delivery, project, params, since = pipe.hmget(
                key, "status", "delivery", "project", "params", "running_since")
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
            holds.accrue_on_end(pipe, {"project": project, "params": params, "running_since": since}, now)
            self._move_index(pipe, job_id, current, status)
            self._event(pipe, job_id, "status", {"status": status.value, "error": error})

        self.redis.transaction(txn, key)
        return done[0]


def _finish_message(status: JobStatus, error: str | None) -> str:
    if status is JobStatus.succeeded:
        return "finished"
    if status is JobStatus.cancelled:
        return "cancelled by request"
    return error or "failed"
