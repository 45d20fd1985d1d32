"""How a job outlives a delivery that ended without finishing it: the delivery gives it back
(`requeue`: its worker shuts down, its device broke), or a worker's sweep finds it abandoned (a
lease that expired on Redis's clock, a process of this worker that died, a dispatch whose message
never arrived, files an ended job's owner never settled).

One rule for all of them (`_back_to_queue`): the job returns to `queued` with a fresh delivery
token and a dispatch intent, or fails once it has had `max_attempts` deliveries. Every sweep is
bounded and idempotent, so any number of workers may run it at once (worker/runtime/heartbeat.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import redis
from redis.commands.core import Script

from core import keys
from core.access import holds
from core.access.projects import project_of
from core.clock import redis_now, seconds_from_time_reply, utc_now_iso
from core.jobs.records import JobStoreBase, log, new_token
from core.queue import TrainDelivery, waiting_task_ids
from core.schemas import JobStatus

# Overdue dispatches and unsettled jobs looked at per sweep.
RECOVERY_BATCH = 200


@dataclass(frozen=True)
class Settlement:
    """Files of an ended job still to settle: promote `promote` from delivery `token`, clean the rest."""

    job_id: str
    token: str
    promote: list[str]


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


class Recovery(JobStoreBase):
    """The job store's side of giving a job back, and of a worker's sweep."""

    @cached_property
    def _postpone_dispatch(self) -> Script:
        return self.redis.register_script(_POSTPONE_DISPATCH)

    def requeue(self, job_id: str, token: str, reason: str) -> bool:
        """Give this delivery's running job back to its queue (its worker is shutting down, or its
        device broke): checked against the token inside the transaction, and bounded like the
        sweep: a job already delivered `max_attempts` times fails instead. True when this call
        requeued or failed the job."""
        return self._back_to_queue(job_id, reason, token=token)

    # ------------------------------------------------------------------ a worker's sweep
    def sweep_expired_leases(self, now: float | None = None) -> list[str]:
        """Redeliver every running job whose lease expired by `now` (Redis's clock).

        The caller makes sure `now` is trustworthy: read just before, in a round trip that did not
        stall, by a sweeper that has seen Redis answer for at least a lease TTL (worker/runtime/heartbeat.py):
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

    def release_held(self, now: float | None = None) -> list[str]:
        """Re-send the held jobs (core/access/holds.py) whose project has room now, oldest first,
        and forget the ones no longer queued (cancelled meanwhile). Not a recovery: nothing is
        counted or logged as one. A re-sent job gets its dispatch intent back, and its claim
        judges it again in its own transaction, so releasing one too many only parks it again."""
        now = redis_now(self.redis) if now is None else now
        held = self.redis.zrange(keys.QUOTA_HELD, 0, RECOVERY_BATCH - 1)
        if not held:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for job_id in held:
            pipe.hmget(keys.job(job_id), "status", "delivery", "queue", "project", "params")
        room: dict[str, tuple[dict[str, int], dict[str, float]]] = {}
        released: list[str] = []
        for job_id, (status, token, queue, project_field, params) in zip(held, pipe.execute(), strict=True):
            if status != JobStatus.queued.value or not token or not queue:
                self.redis.zrem(keys.QUOTA_HELD, job_id)
                continue
            project = project_of(project_field)
            if project not in room:
                room[project] = (holds.read_limits(self.redis, project), holds.usage(self.redis, project, now))
            limits, used = room[project]
            devices = holds.devices_of({"params": params})
            reason = holds.hold_reason(limits, used, project, devices, now) if limits else None
            if reason is not None:  # still held: its message says for which quota now
                self._note_held(job_id, token, reason)
                continue
            used["running_jobs"] += 1  # this one's place, for the next held job of the project
            used["devices_held"] += devices
            if not self._unhold(job_id, token, now):
                continue
            self._send(TrainDelivery(job_id, token, queue))
            released.append(job_id)
        return released

    def _note_held(self, job_id: str, token: str, reason: str) -> None:
        """Set a held job's message to why it waits now, only while it is still queued under `token`."""
        key = keys.job(job_id)

        def txn(pipe: redis.client.Pipeline) -> None:
            if pipe.hmget(key, "status", "delivery") == [JobStatus.queued.value, token]:
                pipe.multi()
                pipe.hset(key, "message", reason)

        self.redis.transaction(txn, key)

    def _unhold(self, job_id: str, token: str, now: float) -> bool:
        """Move a held job back to dispatch, if it is still queued under `token` and held."""
        key = keys.job(job_id)
        moved: list[bool] = []

        def txn(pipe: redis.client.Pipeline) -> None:
            moved.clear()
            status, delivery = pipe.hmget(key, "status", "delivery")
            if status != JobStatus.queued.value or delivery != token or pipe.zscore(keys.QUOTA_HELD, job_id) is None:
                moved.append(False)
                return
            pipe.multi()
            pipe.zrem(keys.QUOTA_HELD, job_id)
            pipe.zadd(keys.DISPATCH_DUE, {job_id: now + self.dispatch_grace_s})
            pipe.hset(key, "message", "queued: its project has room again")
            moved.append(True)

        self.redis.transaction(txn, key, keys.QUOTA_HELD)
        return moved[0]

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
            holds.accrue_on_end(pipe, raw, now)
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
