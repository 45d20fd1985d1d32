"""Aliases: stable names ("pets") that clients predict with, each pointing at a succeeded training job.

Why they live in Redis beside the jobs: a move must be atomic against the job it names and
against /predict. A move is one WATCH/MULTI transaction over the target job's record and the
alias's: the target is a succeeded training job *at the moment of the move* (a delete or any
change of the job in between aborts and retries it), and the move, the name → job index that
/predict reads and the history entry are written together, so they never disagree. /predict
resolves a name and queues the request in one script that checks the name still points at the
job it resolved (app/api/serving/transport.py), so a request is answered by exactly one job.

Promotion (`AliasService.promote`) preloads before it moves: the new target is loaded on every live
device that holds the current target resident (core/preloading.py, bounded wait), so the first
requests after the move find it loaded; the old one leaves the device caches by the usual LRU rule.

Who moved it: the API key is one shared key, so the history records the caller's address, its
User-Agent (the CLI and SDK send `torchyard-client/<version> (<user>@<host>)`) and an optional
note. The history is kept (capped at HISTORY_MAX moves per name), across deletes too.

Keys (core/keys.py): `ty:aliases` (name → job id), `ty:alias:<name>` (the record),
`ty:alias:<name>:history` (the moves, oldest first).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from core import keys
from core.access.models import DEFAULT_PROJECT
from core.access.projects import home, project_of, scoped_name, unscoped_name, visible
from core.clock import utc_now_iso
from core.errors import Conflict, InvalidInput, NotFound
from core.kind_words import job_phrase
from core.schemas import Alias, AliasHistory, AliasMove, AliasUpdate, JobKind, JobStatus, WarmResult
from core.storage import validate_id

HISTORY_MAX = 1000
# Lowercase letters, digits, '.', '_' and '-', starting and ending with a letter or digit: safe in
# URLs, Redis keys, file names and shells without quoting, and "Pets" can never shadow "pets".
_NAME = re.compile(r"^[a-z0-9](?:[a-z0-9._-]{0,62}[a-z0-9])?$")
NAME_RULE = "1 to 64 characters of a-z, 0-9, '.', '_' and '-', starting and ending with a letter or digit"


def validate_alias_name(name: str) -> str:
    if not _NAME.fullmatch(name) or ".." in name:
        raise InvalidInput(f"invalid alias name {name[:80]!r}: {NAME_RULE}")
    return name


@dataclass(frozen=True)
class Caller:
    """Who asks for a move, as far as the API can tell (the API key is shared)."""

    address: str | None = None
    user_agent: str | None = None
    note: str | None = None


def job_is_aliased(client: redis.Redis, job_id: str) -> list[str]:
    """The aliases that point at `job_id` (sorted; empty when none): such a job must not be deleted.
    An alias points at a job of its own project, so its plain name is the one to give.

    For the job-deletion protections (core/retention.py): a delete that WATCHes `keys.ALIASES` in its transaction
    is aborted by any move that happens between this check and the delete."""
    return sorted(unscoped_name(name)[1] for name, target in client.hgetall(keys.ALIASES).items() if target == job_id)


def _record(raw: dict[str, str]) -> Alias:
    return Alias.model_validate({**raw, "project": raw.get("project") or DEFAULT_PROJECT,
                                 "previous_job_id": raw.get("previous_job_id") or None,
                                 "updated_by": raw.get("updated_by") or None, "note": raw.get("note") or None,
                                 "moves": int(raw.get("moves", 1))})


class AliasStore:
    """Alias records in Redis. Synchronous, like the job store (the API calls it from its thread pool)."""

    def __init__(self, client: redis.Redis) -> None:
        self.redis = client

    # ------------------------------------------------------------------ read
    # A name is unique within a project: each is stored under `scoped_name` (core/access/projects.py),
    # the name itself in "default" (every alias from before projects keeps its keys).
    def get(self, name: str) -> Alias:
        raw = self.redis.hgetall(keys.alias(scoped_name(validate_alias_name(name))))
        if not raw:
            raise NotFound(f"alias {name} not found")
        return _record(raw)

    def target(self, name: str) -> str | None:
        return self.redis.hget(keys.ALIASES, scoped_name(validate_alias_name(name)))

    def list(self) -> list[Alias]:
        """The aliases the request sees: its project's (an admin's: every project's)."""
        names = sorted(n for n in self.redis.hkeys(keys.ALIASES) if visible(unscoped_name(n)[0]))
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(keys.alias(name))
        return [_record(raw) for raw in pipe.execute() if raw]

    def history(self, name: str, limit: int = 100) -> AliasHistory:
        """Newest first. An alias that was deleted still has its history."""
        stored = scoped_name(validate_alias_name(name))
        entries = self.redis.lrange(keys.alias_history(stored), -limit, -1)
        if not entries and not self.redis.exists(keys.alias(stored)):
            raise NotFound(f"alias {name} not found (and has no history)")
        return AliasHistory(name=name, moves=[AliasMove.model_validate_json(e) for e in reversed(entries)])

    def check_target(self, job_id: str) -> str:
        """The job's model if it can be an alias's target now; 404/409 otherwise (before any preloading)."""
        validate_id(job_id, "job_id")
        raw = self.redis.hgetall(keys.job(job_id))
        return _target_model(job_id, raw, home())

    # ------------------------------------------------------------------ write
    def move(self, name: str, job_id: str, caller: Caller, *, action: str = "set") -> Alias:
        """Point `name` at `job_id` (creating it), atomically with the check that the job can be its target."""
        validate_alias_name(name)
        validate_id(job_id, "job_id")
        project = home()
        stored = scoped_name(name, project)
        alias_key, job_key = keys.alias(stored), keys.job(job_id)

        def txn(pipe: redis.client.Pipeline) -> None:
            model = _target_model(job_id, pipe.hgetall(job_key), project)
            current = pipe.hgetall(alias_key)
            old = current.get("job_id") or None
            now = utc_now_iso()
            record = {"name": name, "project": project, "job_id": job_id, "model": model, "updated_at": now,
                      "updated_by": caller.address or "", "note": caller.note or "",
                      "created_at": current.get("created_at") or now,
                      "moves": int(current.get("moves", 0)) + 1,
                      # a move to where it already points keeps the way back
                      "previous_job_id": (current.get("previous_job_id") or "") if old == job_id else (old or "")}
            pipe.multi()
            pipe.hset(alias_key, mapping=record)
            pipe.hset(keys.ALIASES, stored, job_id)
            self._append(pipe, stored, action, old, job_id, caller, now)

        self.redis.transaction(txn, job_key, alias_key)
        return self.get(name)

    def delete(self, name: str, caller: Caller) -> None:
        stored = scoped_name(validate_alias_name(name))
        alias_key = keys.alias(stored)

        def txn(pipe: redis.client.Pipeline) -> None:
            old = pipe.hget(alias_key, "job_id")
            if old is None:
                raise NotFound(f"alias {name} not found")
            pipe.multi()
            pipe.delete(alias_key)
            pipe.hdel(keys.ALIASES, stored)
            self._append(pipe, stored, "delete", old, None, caller, utc_now_iso())

        self.redis.transaction(txn, alias_key)

    @staticmethod
    def _append(pipe: Any, stored: str, action: str, old: str | None, new: str | None, caller: Caller,
                at: str) -> None:
        entry = {"action": action, "at": at, "from_job_id": old, "to_job_id": new, "by": caller.address,
                 "user_agent": caller.user_agent, "note": caller.note}
        pipe.rpush(keys.alias_history(stored), json.dumps(entry))
        pipe.ltrim(keys.alias_history(stored), -HISTORY_MAX, -1)


def _target_model(job_id: str, raw: dict[str, str], project: str) -> str:
    """The model of `job_id` if an alias of `project` may point at it: a succeeded training job of
    that project (another project's job does not exist for it: 404)."""
    if not raw or not visible(project_of(raw.get("project"))):
        raise NotFound(f"job {job_id} not found")
    if project_of(raw.get("project")) != project:  # an admin's: seen, but of another project
        raise Conflict(f"job {job_id} is of project {project_of(raw.get('project'))!r}; an alias of project "
                       f"{project!r} points at its own project's jobs (?project= names the alias's)")
    if raw.get("kind", JobKind.train.value) != JobKind.train.value:
        raise Conflict(f"job {job_id} is {job_phrase(raw['kind'], json.loads(raw.get('params') or '{}'))}; an alias "
                       f"points at a training job")
    if raw.get("status") != JobStatus.succeeded.value:
        raise Conflict(f"job {job_id} is {raw.get('status')}; an alias can only point at a succeeded job")
    return raw.get("model", "")


# How a promotion warms: (job to load, job whose devices should load it) → one result per device.
Warm = Callable[[str, str], list[WarmResult]]


class AliasService:
    """Promotion and rollback: check the target, warm it where the old target is resident, move."""

    def __init__(self, store: AliasStore, warm: Warm) -> None:
        self.store = store
        self.warm = warm

    def promote(self, name: str, job_id: str, caller: Caller, *, action: str = "set") -> AliasUpdate:
        validate_alias_name(name)
        self.store.check_target(job_id)  # 404 / 409 before anything is loaded anywhere
        old = self.store.target(name)
        warmed = self.warm(job_id, old) if old and old != job_id else []
        failed = [w for w in warmed if w.status == "failed"]
        if failed:
            # A model a worker cannot load would fail every request after the move: refuse it.
            raise Conflict(f"alias {name} not moved: job {job_id}'s model cannot be loaded on "
                           f"{failed[0].device}: {failed[0].detail}")
        alias = self.store.move(name, job_id, caller, action=action)
        return AliasUpdate(**alias.model_dump(), warm=warmed)

    def rollback(self, name: str, caller: Caller) -> AliasUpdate:
        alias = self.store.get(name)
        if not alias.previous_job_id:
            raise Conflict(f"alias {name} has no previous target to roll back to")
        return self.promote(name, alias.previous_job_id, caller, action="rollback")
