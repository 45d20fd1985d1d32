"""Who a request is and whether its role may do it (core/access/), applied on the API's side.

Three parts, each where it must run:

- `KeyCheck`, in the front gate (app/api/front.py), on the headers before any body byte: the
  bootstrap `TORCHYARD_API_KEY` (an admin of project "default", compared in constant time, no
  Redis read, so a single user's service works as before), or a key created by POST /keys (its
  record read from Redis, its salted hash compared: core/access/keystore.py). The principal is
  put in the request's scope (`PRINCIPAL`). With no key set, access control is off: every request
  is the admin of "default", as before keys existed.
- `authorize`, a FastAPI dependency on every router behind the key: the route's template and
  method looked up in core/access/roles.POLICY; a role without the ability is a 403 naming the
  roles that have it. The gate applies the same table to the routes it serves itself (/predict,
  /v2), before their bodies.
- `Auditor`, in the gate after the response: changes and refusals into the audit log.

Why a record cache of at most `CACHE_S` per process: a request per key would otherwise cost one
Redis read more; a revoked key must stop working in every API process within a second (the
issue's promise), so a cached record is read again once it is half a second old.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable
from typing import Annotated, Any

import redis
import redis.asyncio as aioredis
from fastapi import Query, Request
from starlette.types import Scope

from core import keys
from core.access import audit
from core.access.keystore import BOOTSTRAP, OPEN, Principal, fetch_record, key_id_of, verify
from core.access.models import PROJECT_PATTERN, Quota
from core.access.projects import Acting, acting, set_acting
from core.access.roles import ROLE_ABILITIES, Role, needed, roles_allowed
from core.config import Settings
from core.errors import Forbidden, OverQuota, Unavailable

log = logging.getLogger(__name__)

PRINCIPAL = "torchyard.principal"  # the scope key the gate puts the caller's Principal under
CACHE_S = 0.5  # how old a key's record read from Redis may be when it decides a request
CACHE_ENTRIES = 4096  # a process's cache never grows with a client's guesses past this
UNSAFE = frozenset({"POST", "PUT", "PATCH", "DELETE"})
NOT_AUDITED = ("/predict", "/v2")  # predictions change nothing, and are the hot path


def bearer_token(authorization: bytes | None) -> bytes:
    scheme, _, token = (authorization or b"").strip().partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b""


class KeyCheck:
    """The gate's key check: the bootstrap key, else a created key's record (cached ≤ CACHE_S)."""

    def __init__(self, settings: Settings, clock: Callable[[], float] = time.monotonic) -> None:
        self.key = settings.api_key.get_secret_value().encode() if settings.api_key else None
        self.clock = clock  # monotonic seconds (a test's own clock checks the cache's bound)
        self._records: dict[str, tuple[float, dict[str, str]]] = {}

    @property
    def enabled(self) -> bool:
        return self.key is not None

    async def principal(self, authorization: bytes | None, client: Callable[[], aioredis.Redis]) -> Principal | None:
        """Who sent `authorization`, or None (a 401). Unavailable when Redis cannot say."""
        if self.key is None:
            return OPEN
        given = bearer_token(authorization)
        if hmac.compare_digest(given, self.key):  # constant time, whatever `given` is
            return BOOTSTRAP
        secret = given.decode("latin-1")
        key_id = key_id_of(secret)
        if key_id is None:
            return None
        now = self.clock()
        cached = self._records.get(key_id)
        if cached is None or now - cached[0] > CACHE_S:
            try:
                cached = (now, await fetch_record(client(), key_id))
            except redis.RedisError as exc:
                raise Unavailable(f"Redis is unavailable, retry shortly: {exc}", retry_after_s=2) from exc
            if len(self._records) >= CACHE_ENTRIES:
                self._records.clear()
            self._records[key_id] = cached
        return verify(cached[1], secret, time.time())


def principal_of(scope: Scope) -> Principal:
    """The caller the gate found; OPEN when the gate did not run (an app without one: no key)."""
    found = scope.get(PRINCIPAL)
    return found if isinstance(found, Principal) else OPEN


def check(principal: Principal, method: str, route: str) -> None:
    """Forbidden unless the principal's role may do (method, route)."""
    ability = needed(method, route)
    if ability in ROLE_ABILITIES[principal.role]:
        return
    allowed = " or ".join(role.value for role in roles_allowed(ability))
    raise Forbidden(f"key {principal.name!r} has role {principal.role.value}, which may not {ability.value} "
                    f"({method} {route}); that needs a key with role {allowed}")


def acting_for(principal: Principal) -> Acting:
    """An admin sees every project (and makes in its key's); any other key its own project only."""
    return Acting(principal.project, None if principal.role is Role.admin else principal.project)


async def authorize(request: Request, project: Annotated[str | None, Query(
        pattern=PROJECT_PATTERN, description="an admin: act in this project only (see and make its objects); "
                                             "another key: its own project, or a 403")] = None) -> None:
    """The per-route dependency: the role table applied to the route FastAPI matched, then an
    admin's `?project=` (set here, in the request's task: the route's thread-pool call inherits it)."""
    route = getattr(request.scope.get("route"), "path", request.url.path)
    principal = principal_of(request.scope)
    check(principal, request.method, route)
    if project is None or project == acting().sees:
        return
    if principal.role is not Role.admin:
        raise Forbidden(f"key {principal.name!r} acts in project {principal.project!r} only; "
                        f"?project={project} needs an admin key")
    set_acting(Acting(project, project))  # the gate resets the request's context when it ends


async def caller(request: Request) -> Principal:
    """The caller, for a route that records or shows who it is (POST /keys, GET /whoami)."""
    return principal_of(request.scope)


class PredictRate:
    """A project's `predict_per_second` quota on /predict and /v2 infer, in the gate, before the body:
    one counter per project and second in Redis (INCR + EXPIRE, shared by every API process). The
    quota itself is read at most once a second per process and project, so a project without one
    costs the hot path no Redis call but that."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._limits: dict[str, tuple[float, int | None]] = {}

    async def admit(self, project: str, client: aioredis.Redis) -> None:
        """OverQuota past the project's quota. Redis away: no check (the request then meets the same
        outage where it is queued, and is answered 503 there)."""
        try:
            await self._admit(project, client)
        except redis.RedisError:
            return

    async def _admit(self, project: str, client: aioredis.Redis) -> None:
        now = self.clock()
        cached = self._limits.get(project)
        if cached is None or now - cached[0] > 1.0:
            raw = await client.get(keys.project_quota(project))
            cached = (now, Quota.model_validate_json(raw).predict_per_second if raw else None)
            if len(self._limits) >= CACHE_ENTRIES:
                self._limits.clear()
            self._limits[project] = cached
        limit = cached[1]
        if limit is None:
            return
        if limit > 0:
            counter = keys.project_predictions(project, int(now))
            async with client.pipeline(transaction=False) as pipe:
                pipe.incr(counter)
                pipe.expire(counter, 2)
                count, _ = await pipe.execute()
            if count <= limit:
                return
        raise OverQuota(f"project {project!r} is at its quota of predict_per_second = {limit}", retry_after_s=1)


class Auditor:
    """Writes the gate's audit entries: changes and refusals (core/access/audit.py says which)."""

    def __init__(self, settings: Settings) -> None:
        self.max_entries = settings.audit_max_entries

    @staticmethod
    def wanted(method: str, path: str, status: int) -> bool:
        if status == 403:
            return True
        return method in UNSAFE and not any(path == p or path.startswith(p + "/") for p in NOT_AUDITED)

    async def record(self, client: aioredis.Redis | None, scope: Scope, principal: Principal, status: int,
                     location: str | None) -> None:
        if client is None:
            return
        route = getattr(scope.get("route"), "path", None) or scope["path"]
        params: dict[str, Any] = scope.get("path_params") or {}
        obj = ",".join(f"{k}={v}" for k, v in params.items()) or location
        try:
            await audit.record(client, self.max_entries,
                               audit.entry_fields(principal, scope["method"], route, obj, status))
        except redis.RedisError as exc:  # the request is answered already; its entry is lost, said once here
            log.warning("audit entry for %s %s not written: %s", scope["method"], route, exc)
