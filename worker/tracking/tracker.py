"""The tracking thread of a worker process: ships the enlisted jobs' records to their MLflow runs,
and torchyard's aliases to MLflow's registry, off the training loop.

Never at a job's expense: the training loop only enlists its job (core/tracking.enlist, one ZADD
when a delivery starts); everything else happens here, in a daemon thread that holds the GIL for
a Redis read per enlisted job and tick while nothing changed. A job whose record has not changed
since this thread last shipped it costs the server nothing. While the server is away (down,
slow, refusing), each job is tried again after a doubling wait (up to TORCHYARD_MLFLOW_BACKOFF_MAX_S)
and its record's `mlflow` says what is behind and why; when the server returns, the run catches
up from the record. MLflow's own HTTP retries are cut short here (MLFLOW_HTTP_REQUEST_MAX_RETRIES,
_BACKOFF_FACTOR and _TIMEOUT, unless the operator set them): the backoff is ours, per job.

Every worker runs one; a job is shipped by one of them at a time (`ty:mlflow:lock:<job>`, with a
TTL, so a worker that dies holding it delays the job's run by at most that), and the aliases by
one at a time (`ty:mlflow:aliases:lock`).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from typing import Any

import redis

from core import keys
from core.config import Settings
from core.jobs.records import decode_record
from core.redis import OUTAGE_ERRORS
from core.schemas import Job, JobKind, MlflowRun
from core.storage import CheckpointPaths
from core.tracking import PENDING, RECORD_FIELD, lock_key, read_run_field, write_run_field

log = logging.getLogger(__name__)

_BATCH = 20  # enlisted jobs looked at per tick

# Released only by its holder: the value is the holder's token.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def _mlflow_http_defaults(settings: Settings) -> None:
    """Short HTTP retries for MLflow's client (its defaults wait minutes on a server that is down),
    and no usage telemetry (its thread would try to reach the internet from every worker)."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # a service does not report its use to anyone
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(max(1, settings.mlflow_request_timeout_s))))


class Tracker:
    """The worker's tracking thread (see the module docstring); started only when
    TORCHYARD_MLFLOW_TRACKING_URI is set."""

    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        assert settings.mlflow_tracking_uri
        self.redis = client
        self.settings = settings
        self.paths = CheckpointPaths(settings.checkpoints_dir)
        self.token = secrets.token_hex(8)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._writer: Any = None  # worker/tracking/runs.RunWriter, made in the thread (mlflow's import is slow)
        self._aliases: Any = None  # worker/tracking/registry.AliasSync
        self._shipped: dict[str, tuple[Any, ...]] = {}  # job → the record's fingerprint last shipped in full
        self._failures: dict[str, int] = {}  # job → consecutive failures (its backoff)
        self._hold = ""  # the lock of the job being shipped, renewed before each write
        self._client_error = ""  # why MLflow's client could not be made, as last logged

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="mlflow-tracking", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        try:  # MLflow's import (~2 s of CPU) now, while the worker starts, rather than in a job's first epoch
            self._connect()
        except Exception:
            log.exception("mlflow tracking: the client could not be set up; trying again at each tick")
        else:  # the thread's id: what it costs is read from /proc/<pid>/task/<id>/stat (bench/tracking.py)
            log.info("mlflow tracking: client ready (thread %d)", threading.get_native_id())
        while not self._stop.wait(self.settings.mlflow_poll_s):
            try:
                self.tick()
            except OUTAGE_ERRORS:
                continue  # Redis is away: the records wait there; so do we
            except Exception:
                log.exception("mlflow tracking: a tick failed; trying again")

    def _connect(self) -> None:
        if self._writer is None:
            _mlflow_http_defaults(self.settings)
            from mlflow.tracking import MlflowClient

            from worker.tracking.registry import AliasSync
            from worker.tracking.runs import RunWriter

            assert self.settings.mlflow_tracking_uri
            client = MlflowClient(tracking_uri=self.settings.mlflow_tracking_uri,
                                  registry_uri=self.settings.mlflow_tracking_uri)
            self._writer = RunWriter(client, self.settings.mlflow_tracking_uri, self.settings.mlflow_experiment,
                                     self.paths)
            self._aliases = AliasSync(self.redis, client, self.token, self.settings.mlflow_backoff_max_s)

    def tick(self) -> None:
        """One pass: every enlisted job that is due, then the aliases."""
        now = _redis_now(self.redis)
        due = self.redis.zrangebyscore(PENDING, "-inf", now, start=0, num=_BATCH)
        for job_id in due:
            lock = lock_key(job_id)
            if not self.redis.set(lock, self.token, nx=True, px=self._lock_ttl_ms()):
                continue  # another worker ships it now
            self._hold = lock
            try:
                self.ship(job_id, now)
            except OUTAGE_ERRORS:
                raise
            except Exception:  # a record we cannot read, a bug: this job waits, the others go on
                log.exception("mlflow tracking: job %s could not be shipped", job_id)
                self.redis.zadd(PENDING, {job_id: now + self.settings.mlflow_backoff_max_s})
            finally:
                self.redis.eval(_RELEASE, 1, lock, self.token)
        if (self._writer is not None or self.redis.exists(keys.ALIASES)) and self._client_ready():
            self._aliases.sync(now)

    def _client_ready(self) -> bool:
        """MLflow's client made (once), or False after saying why once per distinct reason: a URI it
        refuses (an unknown scheme) is the operator's to fix, and the jobs' records say it too."""
        try:
            self._connect()
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            if reason != self._client_error:
                log.warning("mlflow tracking: no client for %s (%s)", self.settings.mlflow_tracking_uri, reason)
                self._client_error = reason
            return False
        return True

    def _lock_ttl_ms(self) -> int:
        """Longer than one request and its one retry: the hold is renewed before every write."""
        return int((2 * self.settings.mlflow_request_timeout_s + 5) * 1000)

    def _renew(self, lock: str) -> None:
        if not self.redis.eval(_RENEW, 1, lock, self.token, self._lock_ttl_ms()):
            raise LostHold(f"another worker took over {lock}")

    def ship(self, job_id: str, now: float) -> None:
        raw = self.redis.hgetall(keys.job(job_id))
        if not raw:  # deleted: nothing to track any more
            self.redis.zrem(PENDING, job_id)
            self._forget(job_id)
            return
        job = Job.model_validate(decode_record(raw))
        known = read_run_field(raw.get(RECORD_FIELD))
        fingerprint = (job.status, len(job.metrics), job.device, job.attempts, job.device_choices is not None)
        if self._shipped.get(job_id) == fingerprint:
            return  # nothing new since this thread shipped it
        try:
            self._connect()  # a URI MLflow refuses fails here: the record says so, like a server that is away
            self._writer.before_write = lambda lock=self._hold: self._renew(lock)
            parent, init_from = self._related_runs(job)
            save = lambda run: write_run_field(self.redis, job_id, run)  # noqa: E731
            try:
                state = self._writer.ship(job, known, save, parent_run=parent, init_from_run=init_from)
            except Exception as exc:
                if not _no_such_run(exc):
                    raise
                if not (known is not None and known.run_id):  # the experiment is gone with the store
                    self._writer.forget_experiment()
                    raise
                # The server lost its store (or the run was purged): a new run, made from the record.
                log.warning("mlflow tracking: job %s's run %s is gone from the server; starting a new one",
                            job_id, known.run_id)
                known = None
                self._writer.forget_experiment()
                state = self._writer.ship(job, None, save, parent_run=parent, init_from_run=init_from)
        except OUTAGE_ERRORS:
            raise
        except LostHold:
            self._shipped.pop(job_id, None)
            return  # another worker ships it now
        except Exception as exc:  # the server away, refusing, or a run we cannot write
            self._behind(job, known, exc, now)
            return
        self._failures.pop(job_id, None)
        write_run_field(self.redis, job_id, state)
        if job.status.terminal and not state.behind:
            self.redis.zrem(PENDING, job_id)
            self._forget(job_id)
        elif state.behind:  # the files are settled a moment after the job ends
            self.redis.zadd(PENDING, {job_id: now + self.settings.mlflow_poll_s})
        else:
            self._shipped[job_id] = fingerprint

    def _related_runs(self, job: Job) -> tuple[str | None, str | None]:
        """An evaluation's trained job's run (its parent), a fine-tune's parent job's run (a tag)."""
        if job.kind is JobKind.evaluate:
            trained = str(job.params.get("trained_job", ""))
            run = read_run_field(self.redis.hget(keys.job(trained), RECORD_FIELD))
            if run is None or not run.run_id:
                if self.redis.exists(keys.job(trained)):
                    self.redis.zadd(PENDING, {trained: 0}, nx=True)  # tracked now, so its evaluation can be
                raise ParentPending(f"the trained job {trained} has no MLflow run yet")
            return run.run_id, None
        parent = job.params.get("init_from")
        if parent:
            run = read_run_field(self.redis.hget(keys.job(parent), RECORD_FIELD))
            return None, run.run_id if run is not None else None
        return None, None

    def _behind(self, job: Job, known: MlflowRun | None, exc: Exception, now: float) -> None:
        failures = self._failures.get(job.id, 0) + 1
        self._failures[job.id] = failures
        wait = min(self.settings.mlflow_poll_s * 2 ** (failures - 1), self.settings.mlflow_backoff_max_s)
        self.redis.zadd(PENDING, {job.id: now + wait})
        self._shipped.pop(job.id, None)
        logged = known.epochs_logged if known is not None else 0
        behind = []
        if len(job.metrics) > logged:
            missing = len(job.metrics) - logged
            behind.append(f"{missing} epoch{'s' if missing != 1 else ''}")
        if job.status.terminal:
            behind.append(f"status {job.status.value}")
            if job.status.value == "succeeded":
                behind.append("artifacts")
        if known is None or not known.run_id:
            behind.insert(0, "the run")
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
        if failures == 1 or failures % 20 == 0:
            log.warning("mlflow tracking: job %s is behind (%s): %s; next try in %.0f s", job.id,
                        ", ".join(behind), error, wait)
        write_run_field(self.redis, job.id, (known or MlflowRun()).model_copy(update={"behind": behind,
                                                                                      "error": error}))

    def _forget(self, job_id: str) -> None:
        self._shipped.pop(job_id, None)
        self._failures.pop(job_id, None)


class LostHold(Exception):
    """This worker's hold on a job's run lapsed (a stall longer than its TTL): it stops sending."""


class ParentPending(Exception):
    """An evaluation waits for its trained job's run."""


def _no_such_run(exc: Exception) -> bool:
    return getattr(exc, "error_code", None) == "RESOURCE_DOES_NOT_EXIST"


def client_missing() -> bool:
    """MLflow's client (the `mlflow` extra: mlflow-skinny) is not installed here."""
    import importlib.util

    return importlib.util.find_spec("mlflow") is None


def _redis_now(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return seconds + micros / 1e6
