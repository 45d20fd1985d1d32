"""Aliases: stable names for a succeeded training job that clients predict with (core/aliases.py).

Plain `def` routes: a move waits (bounded) for the new model to load on the devices that serve the
old one, so it runs in the thread pool like the job store's other synchronous calls."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response

from app.api.deps import ServicesDep
from core.aliases import Caller
from core.schemas import Alias, AliasHistory, AliasList, AliasNote, AliasSet, AliasUpdate

router = APIRouter(tags=["aliases"])

_MOVE_ERRORS: dict[int | str, dict[str, Any]] = {404: {"description": "no such job"},
                409: {"description": "the job has not succeeded, is not a training job, or its model cannot "
                                     "be loaded where the old target is resident"},
                422: {"description": "invalid alias name"}}


def _caller(request: Request, note: str | None) -> Caller:
    agent = request.headers.get("user-agent")
    return Caller(address=request.client.host if request.client else None,
                  user_agent=agent[:200] if agent else None, note=note)


@router.get("/aliases", response_model=AliasList)
def list_aliases(services: ServicesDep) -> AliasList:
    """Every alias with the job it points at."""
    return AliasList(aliases=services.aliases.store.list())


@router.get("/aliases/{name}", response_model=Alias, responses={404: {"description": "no such alias"}})
def get_alias(services: ServicesDep, name: str) -> Alias:
    """One alias: its job, that job's model, when and by whom it last moved."""
    return services.aliases.store.get(name)


@router.put("/aliases/{name}", response_model=AliasUpdate, responses={201: {"model": AliasUpdate}, **_MOVE_ERRORS})
def set_alias(services: ServicesDep, name: str, body: AliasSet, request: Request, response: Response) -> AliasUpdate:
    """Point `name` at a succeeded training job, creating (201) or moving (200) it. Before it moves, the
    new model is loaded on every device that holds the old one (`warm`)."""
    alias = services.aliases.promote(name, body.job_id, _caller(request, body.note))
    response.status_code = 201 if alias.moves == 1 else 200
    return alias


@router.post("/aliases/{name}/rollback", response_model=AliasUpdate,
             responses={**_MOVE_ERRORS, 409: {"description": "no previous target, or it can no longer be one"}})
def rollback_alias(services: ServicesDep, name: str, request: Request, body: AliasNote | None = None) -> AliasUpdate:
    """Move `name` back to its previous target (warmed the same way). Rolling back twice returns."""
    return services.aliases.rollback(name, _caller(request, body.note if body else None))


@router.get("/aliases/{name}/history", response_model=AliasHistory,
            responses={404: {"description": "no such alias, and no history of one"}})
def alias_history(services: ServicesDep, name: str,
                  limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> AliasHistory:
    """Every move, newest first: what from, what to, when, by whom (address, User-Agent, note)."""
    return services.aliases.store.history(name, limit)


@router.delete("/aliases/{name}", status_code=204, responses={404: {"description": "no such alias"}})
def delete_alias(services: ServicesDep, name: str, request: Request,
                 note: Annotated[str | None, Query(max_length=500)] = None) -> Response:
    """Remove the name (its history stays); its job can be deleted again."""
    services.aliases.store.delete(name, _caller(request, note))
    return Response(status_code=204)
