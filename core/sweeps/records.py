"""How a sweep is stored in Redis (core/keys.py has the layout): its record, which training job
each trial became, its events, its Idempotency-Key, and the lock that lets one process at a time
advance it. What a sweep *does* is core/sweeps/coordinator.py's; the study is Optuna's."""

from __future__ import annotations

import json
import secrets
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis

from core import keys
from core.access.projects import home, project_of, visible
from core.clock import utc_now_iso
from core.errors import Conflict, InvalidInput, NotFound
from core.storage import validate_id

EVENTS_MAXLEN = 5000
IDEMPOTENCY_TTL_S = 24 * 3600
# A process that advances a sweep holds its lock this long at most: one advance takes well under a
# second (a few Redis reads, an ask, a job created); a process killed holding it delays the sweep
# by this much, never more.
LOCK_TTL_MS = 10_000
ACTIVE_STATUSES = ("running",)
TERMINAL_STATUSES = ("succeeded", "failed", "cancelled")
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


def new_sweep_id() -> str:
    """Time-ordered like job ids (lexicographic = chronological), so lists page by id."""
    return f"{time.time_ns() // 1000:014x}{secrets.token_hex(4)}"


class SweepRecords:
    """Sweep records in Redis. Synchronous: the API's thread pool and its tick use it."""

    def __init__(self, client: redis.Redis) -> None:
        self.redis = client

    # ------------------------------------------------------------------ create and read
    def create(self, record: dict[str, str], idempotency_key: str | None, body_digest: str) -> tuple[str, bool]:
        """(sweep id, created): the record, its indexes, its first event and its Idempotency-Key in one
        transaction; the same key and body again give the first sweep, another body a 422."""
        idem = keys.sweep_idempotency(idempotency_key, record["project"]) if idempotency_key else None
        sweep_id = new_sweep_id()
        earlier: list[str] = []

        def txn(pipe: redis.client.Pipeline) -> None:
            earlier.clear()
            if idem is not None:
                existing = pipe.get(idem)
                if existing:
                    doc = json.loads(existing)
                    if pipe.exists(keys.sweep(doc["sweep"])):
                        if doc.get("body") != body_digest:
                            raise InvalidInput(f"Idempotency-Key {idempotency_key!r} was already used for a "
                                               f"different sweep ({doc['sweep']}); use a new key")
                        earlier.append(doc["sweep"])
                        return
            pipe.multi()
            pipe.hset(keys.sweep(sweep_id), mapping={**record, "id": sweep_id, "status": "running",
                                                     "created_at": utc_now_iso()})
            pipe.zadd(keys.SWEEPS_INDEX, {sweep_id: 0})
            pipe.sadd(keys.SWEEPS_ACTIVE, sweep_id)
            if idem is not None:
                pipe.set(idem, json.dumps({"sweep": sweep_id, "body": body_digest}), ex=IDEMPOTENCY_TTL_S)
            self._event(pipe, sweep_id, "status", {"status": "running"})

        if idem is not None:
            self.redis.transaction(txn, idem)
        else:
            pipe = self.redis.pipeline(transaction=True)
            txn(pipe)
            pipe.execute()
        return (earlier[0], False) if earlier else (sweep_id, True)

    def replay(self, idempotency_key: str | None, body_digest: str) -> str | None:
        """The sweep an earlier request with this key and this very body created, if it still exists:
        looked up before the request is checked again (a retry gets its sweep whatever changed since)."""
        if not idempotency_key:
            return None
        raw = self.redis.get(keys.sweep_idempotency(idempotency_key, home()))
        doc = json.loads(raw) if raw else None
        if not isinstance(doc, dict) or doc.get("body") != body_digest:
            return None
        return doc["sweep"] if self.redis.exists(keys.sweep(doc["sweep"])) else None

    def get(self, sweep_id: str) -> dict[str, str]:
        validate_id(sweep_id, "sweep id")
        raw = self.redis.hgetall(keys.sweep(sweep_id))
        if not raw or not visible(project_of(raw.get("project"))):  # another project's: not there for it
            raise NotFound(f"sweep {sweep_id} not found")
        return raw

    def trial_jobs(self, sweep_id: str) -> tuple[dict[int, str], dict[int, str]]:
        """(trial number -> its job id, trial number -> why its job could not be created)."""
        jobs: dict[int, str] = {}
        errors: dict[int, str] = {}
        for field, value in self.redis.hgetall(keys.sweep_jobs(sweep_id)).items():
            if field.startswith("error:"):
                errors[int(field.removeprefix("error:"))] = value
            else:
                jobs[int(field)] = value
        return jobs, errors

    def page(self, limit: int) -> list[str]:
        """The newest sweeps' ids the request may see (core/access/projects.py), newest first."""
        ids = list(self.redis.zrevrange(keys.SWEEPS_INDEX, 0, -1))
        with self.redis.pipeline(transaction=False) as pipe:
            for sweep_id in ids:
                pipe.hget(keys.sweep(sweep_id), "project")
            projects = pipe.execute()
        return [i for i, p in zip(ids, projects, strict=True) if visible(project_of(p))][:limit]

    def active(self) -> list[str]:
        return sorted(self.redis.smembers(keys.SWEEPS_ACTIVE))

    # ------------------------------------------------------------------ what the coordinator writes
    def set_trial_job(self, sweep_id: str, number: int, job_id: str, params: dict[str, Any]) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(keys.sweep_jobs(sweep_id), str(number), job_id)
        self._event(pipe, sweep_id, "trial", {"number": number, "job_id": job_id, "params": params, "state": "running"})
        pipe.execute()

    def set_trial_error(self, sweep_id: str, number: int, error: str) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(keys.sweep_jobs(sweep_id), f"error:{number}", error)
        self._event(pipe, sweep_id, "trial", {"number": number, "state": "failed", "error": error})
        pipe.execute()

    def trial_told(self, sweep_id: str, number: int, state: str, value: float | None, epoch: int) -> None:
        self.event(sweep_id, "trial", {"number": number, "state": state, "value": value, "epoch": epoch})

    def set_fields(self, sweep_id: str, fields: dict[str, str]) -> None:
        self.redis.hset(keys.sweep(sweep_id), mapping=fields)

    def mark_cancelled(self, sweep_id: str) -> None:
        """Cancelled now (its running trials are stopped next); it stays active until they are told."""
        key = keys.sweep(sweep_id)
        self.get(sweep_id)  # 404 for another project's

        def txn(pipe: redis.client.Pipeline) -> None:
            status = pipe.hget(key, "status")
            if status is None:
                raise NotFound(f"sweep {sweep_id} not found")
            if status in TERMINAL_STATUSES:
                raise Conflict(f"sweep {sweep_id} is already {status}")
            pipe.multi()
            pipe.hset(key, mapping={"status": "cancelled", "cancel_requested": utc_now_iso(),
                                    "message": "cancelled: its running trials are being stopped"})
            # The `status` event comes with the end (finish), after its trials were told.
            self._event(pipe, sweep_id, "cancel_requested", {})

        self.redis.transaction(txn, key)

    def finish(self, sweep_id: str, status: str, fields: dict[str, str]) -> None:
        """The sweep's outcome; it leaves the active set (nothing is left to ask or tell)."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(keys.sweep(sweep_id), mapping={**fields, "status": status, "ended": status,
                                                 "finished_at": utc_now_iso()})
        pipe.srem(keys.SWEEPS_ACTIVE, sweep_id)
        self._event(pipe, sweep_id, "status", {"status": status})
        pipe.execute()

    def delete(self, sweep_id: str) -> None:
        """The record, its trials' jobs index, events, and its study's journal (Optuna's keys)."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(keys.sweep(sweep_id), keys.sweep_jobs(sweep_id), keys.sweep_events(sweep_id))
        pipe.zrem(keys.SWEEPS_INDEX, sweep_id)
        pipe.srem(keys.SWEEPS_ACTIVE, sweep_id)
        pipe.execute()
        journal = list(self.redis.scan_iter(match=f"{keys.OPTUNA_PREFIX}{sweep_id}:*", count=1000))
        for start in range(0, len(journal), 1000):
            self.redis.unlink(*journal[start:start + 1000])

    def event(self, sweep_id: str, kind: str, data: dict[str, Any]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        self._event(pipe, sweep_id, kind, data)
        pipe.execute()

    @staticmethod
    def _event(pipe: redis.client.Pipeline, sweep_id: str, kind: str, data: dict[str, Any]) -> None:
        pipe.xadd(keys.sweep_events(sweep_id), {"event": kind, "data": json.dumps(data)},
                  maxlen=EVENTS_MAXLEN, approximate=True)

    # ------------------------------------------------------------------ one advancer at a time
    @contextmanager
    def lock(self, sweep_id: str) -> Iterator[SweepLock | None]:
        """Yields the sweep's lock when this process took it (another one advancing it: None)."""
        lock = SweepLock(self.redis, keys.sweep_lock(sweep_id), uuid.uuid4().hex)
        held = bool(self.redis.set(lock.key, lock.token, nx=True, px=LOCK_TTL_MS))
        try:
            yield lock if held else None
        finally:
            if held:
                self.redis.eval(_RELEASE, 1, lock.key, lock.token)


class SweepLock:
    """The advance lock as its holder sees it: `renew` before each ask, so a process that lost it
    (paused past its TTL) asks nothing more."""

    def __init__(self, client: redis.Redis, key: str, token: str) -> None:
        self.redis, self.key, self.token = client, key, token

    def renew(self) -> bool:
        return bool(self.redis.eval(_RENEW, 1, self.key, self.token, LOCK_TTL_MS))


# Nudges waiting at most: a push with no API process running to take it must not grow the list.
NUDGES_KEPT = 100


def nudge(client: redis.Redis, sweep_id: str) -> None:
    """Wake an API process's tick now (a trial's job ended): the next trial is asked at once rather
    than at the next tick (app/main.py)."""
    pipe = client.pipeline(transaction=False)
    pipe.lpush(keys.SWEEPS_NUDGE, sweep_id)
    pipe.ltrim(keys.SWEEPS_NUDGE, 0, NUDGES_KEPT - 1)
    pipe.execute()
