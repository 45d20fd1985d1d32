"""MLflow tracking, the shared side: which jobs still owe the tracking server something, and what
a job's record says about its run.

Why the job record is the outbox: a training job already records every epoch's metrics once, in
the same transaction as its resume state (core/jobs/delivery.py), and its status, params, device
choices and kept weights; everything an MLflow run holds is derived from them. So the training
loop writes nothing new for tracking: a worker enlists the job when a delivery starts (one ZADD),
and a background thread of every worker (worker/tracking/) ships what the record holds and the
run does not, at its own pace, backing off while the server is away. The run's id, and how far
behind the run is, are written back to the record's `mlflow` field (only ever by that thread, and
only while the record exists).

Aliases need no outbox either: `ty:aliases` (core/aliases.py) is what MLflow's `current` aliases
must match; the thread compares it with what it last synced (`ty:mlflow:aliases`) and registers
or moves the difference.

Keys (named in core/keys.py): `ty:mlflow:pending` (zset: job id → when to try it next, Redis
time), `ty:mlflow:lock:<job id>` (the one worker shipping that job now), `ty:mlflow:aliases`
(hash: alias name → the job its MLflow `current` points at), `ty:mlflow:aliases:lock`.
"""

from __future__ import annotations

import json
from typing import Any

import redis

from core import keys
from core.schemas import MlflowRun

PENDING = keys.MLFLOW_PENDING
SYNCED_ALIASES = keys.MLFLOW_ALIASES
ALIASES_LOCK = keys.MLFLOW_ALIASES_LOCK
lock_key = keys.mlflow_lock
# The job record's field (a JSON field of core/jobs/records.JSON_FIELDS), written by the tracker only.
RECORD_FIELD = "mlflow"
# The MLflow run tag that names the job: how a run created just before a crash is found again.
JOB_TAG = "torchyard.job_id"


def enlist(client: redis.Redis | redis.client.Pipeline, job_id: str) -> None:
    """Mark the job as owing its run something (now); idempotent."""
    client.zadd(PENDING, {job_id: 0})


# Writes the job's `mlflow` field only while the record exists: a job deleted meanwhile is not
# brought back as a hash of one field.
_WRITE_IF_EXISTS = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  return 1
end
return 0
"""


def write_run_field(client: redis.Redis, job_id: str, run: MlflowRun) -> bool:
    """The record's `mlflow` field; False when the job no longer exists."""
    return bool(client.eval(_WRITE_IF_EXISTS, 1, keys.job(job_id), RECORD_FIELD, run.model_dump_json()))


def read_run_field(raw: str | None) -> MlflowRun | None:
    return MlflowRun.model_validate(json.loads(raw)) if raw else None


def flatten(prefix: str, value: Any, into: dict[str, str]) -> dict[str, str]:
    """Nested params as MLflow's flat string params/tags (`a.b`), lists as JSON."""
    if isinstance(value, dict):
        for key, inner in value.items():
            flatten(f"{prefix}.{key}" if prefix else str(key), inner, into)
    elif value is not None:
        into[prefix] = value if isinstance(value, str) else json.dumps(value)
    return into
