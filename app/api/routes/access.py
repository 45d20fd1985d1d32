"""API keys, the audit log and the caller's own key (core/access/; docs/security.md). Admin only,
but GET /whoami: the role table (core/access/roles.py) says so, applied by app/api/access.py."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Response

from app.api.access import caller
from app.api.deps import ServicesDep
from core.access import audit
from core.access.keystore import Principal
from core.access.models import AuditLog, KeyCreate, KeyCreated, KeyList, Whoami
from core.errors import Conflict

router = APIRouter(tags=["access"])
CallerDep = Annotated[Principal, Depends(caller)]


@router.post("/keys", status_code=201, response_model=KeyCreated,
             responses={409: {"description": "the server has no TORCHYARD_API_KEY: keys would not be checked"},
                        422: {"description": "invalid name, role, project or expiry"}})
def create_key(services: ServicesDep, body: KeyCreate, who: CallerDep) -> KeyCreated:
    """Create a key for a project and role; its `secret` is in this answer only (a salted hash is stored)."""
    if services.settings.api_key is None:
        raise Conflict("this server has no TORCHYARD_API_KEY, so it checks no key: set one (the bootstrap admin "
                       "key), restart the API, then create keys with it")
    return services.access_keys.create(body, created_by=who.key_id)


@router.get("/keys", response_model=KeyList)
def list_keys(services: ServicesDep) -> KeyList:
    """Every key ever created, oldest first: name, role, project, expiry, revocation; never a secret."""
    return KeyList(keys=services.access_keys.list())


@router.delete("/keys/{key_id}", status_code=204, responses={404: {"description": "no such key"}})
def revoke_key(services: ServicesDep, key_id: str) -> Response:
    """Revoke a key: every API process refuses it (401) within a second. Its record stays, revoked."""
    services.access_keys.revoke(key_id)
    return Response(status_code=204)


@router.get("/audit", response_model=AuditLog, responses={422: {"description": "invalid limit or cursor"}})
def read_audit(services: ServicesDep, limit: Annotated[int, Query(ge=1, le=1000)] = 100,
               before: Annotated[str | None, Query(pattern=r"^\d{1,20}-\d{1,20}$",
                                                   description="an entry id: only older entries")] = None) -> AuditLog:
    """Who (key id and name) did what (method, route, object) with what result, newest first: every
    change and every 403; kept TORCHYARD_KEEP_AUDIT_DAYS, at most TORCHYARD_AUDIT_MAX_ENTRIES."""
    return AuditLog(entries=audit.read(services.redis, limit, before))


@router.get("/whoami", response_model=Whoami)
async def whoami(who: CallerDep) -> Whoami:
    """The key this request was sent with: its id, name, role and project (no secret)."""
    return Whoami(key_id=who.key_id, name=who.name, role=who.role, project=who.project)
