"""What the protocol calls a model: an alias or a training job id, its versions, and what it takes.

Names: an alias (core/aliases.py) or the id of a training job. An alias's versions are the jobs it
has pointed at, numbered 1, 2, ... in the order its history first names them (the protocol's
tools read a version as an integer: perf_analyzer parses it with `std::stoll`); a job id has one
version, "1". Without a version, an alias is served by whatever it names when the request is
queued (the engine resolves it atomically, as /predict does); with one, by that job. An evaluation,
export or batch-prediction job is not a model: 404, as an unknown name is.

What a model takes and gives comes from the job's record, never from a worker: the input's
(channels, height, width) as its params resolved them, the classes it was trained on. Both are
fixed once a job succeeded, so they are cached per job id (bounded); whether it still exists and
succeeded is what the engine's queueing script checks on every request.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass

import redis.asyncio as aioredis

from core import keys
from core.access.projects import Acting, acting, home, project_of, scoped_name, unscoped_name, visible
from core.errors import NotFound
from core.jobs.records import decode_record
from core.kinds import TrainingParams
from core.schemas import Job, JobKind, JobStatus
from core.storage import validate_id

CACHED_JOBS = 1024
RESOLVED_S = 1.0  # how long a name's resolution is reused (ModelCatalog.resolve)
JOB_VERSION = "1"


@dataclass(frozen=True)
class ModelInfo:
    """A training job as a model: what it takes and gives."""

    job_id: str
    architecture: str
    classes: tuple[str, ...]
    shape: tuple[int, int, int]  # (C, H, W) of INPUT__0
    ready: bool  # succeeded when it was read (a job's status is re-checked by each request's queueing)
    project: str = "default"  # whose: another project's job is no model for a request (core/access/projects.py)


@dataclass(frozen=True)
class ModelRef:
    """A name (and version) resolved: `alias` set when the request goes by the alias (no version asked)."""

    name: str
    versions: tuple[str, ...]  # job ids, version i + 1 at index i
    version: str
    info: ModelInfo
    alias: str | None

    def version_of(self, job_id: str) -> str:
        """The version number of `job_id` under this name (the newest when the alias moved since)."""
        if job_id in self.versions:
            return str(self.versions.index(job_id) + 1)
        return self.version


class ModelCatalog:
    def __init__(self, client: aioredis.Redis) -> None:
        self.redis = client
        self._jobs: OrderedDict[str, ModelInfo] = OrderedDict()  # succeeded training jobs only
        # (whose view, name, version) → (when, ref): a name means another model in another project
        self._resolved: dict[tuple[Acting, str, str | None], tuple[float, ModelRef]] = {}

    async def resolve(self, name: str, version: str | None = None) -> ModelRef:
        """`name` (and `version`, when given) as a model; 404 when it is none. Remembered for
        RESOLVED_S: an infer would otherwise pay a Redis round trip for it, and what it decides stays
        right when an alias moves meanwhile (the request goes by the alias, which the engine resolves
        when it queues it; only the version number reported may lag by that long)."""
        now = time.monotonic()
        key = (acting(), name, version)
        known = self._resolved.get(key)
        if known is not None and now - known[0] < RESOLVED_S:
            return known[1]
        ref = await self._resolve(name, version)
        if len(self._resolved) >= CACHED_JOBS:
            self._resolved.clear()
        self._resolved[key] = (now, ref)
        return ref

    async def _resolve(self, name: str, version: str | None) -> ModelRef:
        target = await self.redis.hget(keys.ALIASES, scoped_name(name)) if len(name) <= 64 else None
        if target is not None:
            versions = await self._alias_versions(scoped_name(name), target)
            if version is None:
                return ModelRef(name, versions, str(versions.index(target) + 1), await self.job(target), name)
            job_id = self._pick(name, versions, version)
            return ModelRef(name, versions, version, await self.job(job_id), None)
        info = await self.job(name, unknown=f"model {name!r} not found: not an alias nor a training job id")
        if version is not None:
            self._pick(name, (name,), version)
        return ModelRef(name, (name,), JOB_VERSION, info, None)

    @staticmethod
    def _pick(name: str, versions: tuple[str, ...], version: str) -> str:
        if not version.isdigit() or not 1 <= int(version) <= len(versions):
            raise NotFound(f"model {name!r} has no version {version[:40]!r}; its versions are 1 to {len(versions)}")
        return versions[int(version) - 1]

    async def _alias_versions(self, stored: str, target: str) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for raw in await self.redis.lrange(keys.alias_history(stored), 0, -1):
            job_id = json.loads(raw).get("to_job_id")
            if job_id:
                seen.setdefault(job_id, None)
        seen.setdefault(target, None)  # a history trimmed past its first move still has the current target
        return tuple(seen)

    async def job(self, job_id: str, unknown: str | None = None) -> ModelInfo:
        """The training job `job_id` as a model (cached once it succeeded); 404 for any other kind."""
        missing = unknown or f"job {job_id} not found"
        cached = self._jobs.get(job_id)
        if cached is not None:
            self._jobs.move_to_end(job_id)
            if not visible(cached.project):
                raise NotFound(missing)
            return cached
        try:
            validate_id(job_id, "model")
        except Exception:
            raise NotFound(missing) from None
        raw = await self.redis.hgetall(keys.job(job_id))
        if not raw or not visible(project_of(raw.get("project"))):
            raise NotFound(missing)
        job = Job.model_validate(decode_record(raw))
        if job.kind != JobKind.train:
            raise NotFound(f"job {job_id} is a {job.kind.value} job, not a model: name a training job or an alias")
        params = TrainingParams.of(job)
        assert isinstance(params, TrainingParams)
        info = ModelInfo(job.id, job.model, tuple(job.classes or ()), params.input_for(job.model),
                         job.status == JobStatus.succeeded, job.project)
        if info.ready and info.classes:
            self._jobs[job_id] = info
            while len(self._jobs) > CACHED_JOBS:
                self._jobs.popitem(last=False)
        return info

    async def index(self, limit: int = 1000) -> list[tuple[str, str, bool]]:
        """(name, version, ready) of every alias, then the newest succeeded training jobs: the repository."""
        entries: list[tuple[str, str, bool]] = []
        for stored, target in sorted((await self.redis.hgetall(keys.ALIASES)).items()):
            project, name = unscoped_name(stored)
            if not visible(project) or project != home():
                continue  # another project's (an admin names aliases of its own project, or ?project='s)
            ref = await self.resolve(name)
            entries.append((name, ref.version_of(target), ref.info.ready))
        for job_id in await self.redis.zrevrange(keys.jobs_with_status(JobStatus.succeeded.value), 0, limit - 1):
            try:
                info = await self.job(job_id)
            except NotFound:
                continue  # another kind of job
            entries.append((job_id, JOB_VERSION, info.ready))
        return entries
