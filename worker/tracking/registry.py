"""torchyard's aliases as MLflow registered models: `PUT /aliases/{name}` registers the job's
weights as a version of the registered model `{name}` (once per job: the version is found again by
its run) and points the model's MLflow alias `current` at it; a rollback moves `current` back to
the earlier job's version. Deleting a torchyard alias leaves the registry as it is (its versions
are the history; `current` keeps naming the last target). An alias of a project other than
"default" (stored `<project>:<name>`, core/access/projects.py) is the registered model
`<project>+<name>`: MLflow refuses ':' in a name, and '+' is in no alias name, so no two meet.

Nothing is queued for this by the API: `ty:aliases` (core/aliases.py) is what `current` must match,
and `ty:mlflow:aliases` what it was last set to; the tracking thread registers the difference.
A target whose run is not complete yet (its artifacts still behind) is enlisted and waits.
"""

from __future__ import annotations

import logging

import redis
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from core import keys
from core.tracking import ALIASES_LOCK, JOB_TAG, PENDING, RECORD_FIELD, SYNCED_ALIASES, read_run_field

log = logging.getLogger(__name__)

ALIAS = "current"


class AliasSync:
    """One pass at a time, by one worker at a time (`ty:mlflow:aliases:lock`)."""

    def __init__(self, client: redis.Redis, mlflow: MlflowClient, token: str, backoff_max_s: float) -> None:
        self.redis = client
        self.mlflow = mlflow
        self.token = token
        self.backoff_max_s = backoff_max_s
        self._next_try = 0.0
        self._failures = 0

    def sync(self, now: float) -> None:
        if now < self._next_try:
            return
        wanted = self.redis.hgetall(keys.ALIASES)
        synced = self.redis.hgetall(SYNCED_ALIASES)
        todo = {name: job for name, job in wanted.items() if synced.get(name) != job}
        if not todo or not self.redis.set(ALIASES_LOCK, self.token, nx=True, ex=120):
            return
        try:
            for name, job_id in sorted(todo.items()):
                self._sync_one(name, job_id)
            self._failures = 0
        except Exception as exc:  # the server away or refusing (MlflowException, a connection error)
            self._failures += 1
            wait = min(2.0 ** self._failures, self.backoff_max_s)
            self._next_try = now + wait
            if self._failures == 1 or self._failures % 20 == 0:
                log.warning("mlflow registry: aliases not synced (%s); next try in %.0f s",
                            str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__, wait)
        finally:
            if self.redis.get(ALIASES_LOCK) == self.token:
                self.redis.delete(ALIASES_LOCK)

    def _sync_one(self, stored: str, job_id: str) -> None:
        name = registered_name(stored)
        run = read_run_field(self.redis.hget(keys.job(job_id), RECORD_FIELD))
        if run is None or not run.run_id or run.status != "FINISHED":  # its weights not logged yet
            if self.redis.exists(keys.job(job_id)):
                self.redis.zadd(PENDING, {job_id: 0}, nx=True)  # its run first (a job trained before tracking)
            return
        version = self._version_of(name, run.run_id) or self._register(name, job_id, run.run_id)
        self.mlflow.set_registered_model_alias(name, ALIAS, version)
        self.redis.hset(SYNCED_ALIASES, stored, job_id)
        log.info("mlflow registry: %s@%s is version %s (job %s)", name, ALIAS, version, job_id)

    def _version_of(self, name: str, run_id: str) -> str | None:
        try:
            versions = self.mlflow.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise
        return min((v.version for v in versions), key=int) if versions else None

    def _register(self, name: str, job_id: str, run_id: str) -> str:
        try:
            self.mlflow.create_registered_model(name, tags={"torchyard.alias": name})
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        source = f"{self.mlflow.get_run(run_id).info.artifact_uri}/model"
        return str(self.mlflow.create_model_version(name, source, run_id=run_id, tags={JOB_TAG: job_id}).version)


def registered_name(stored: str) -> str:
    """The MLflow registered model of a stored alias name: the name itself in "default"."""
    return stored.replace(":", "+", 1)
