from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from app.api.deps import ServicesDep, bearer_scheme
from core.schemas import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
def healthz() -> Health:
    """Alive. No dependencies and no auth, for orchestrators."""
    return Health(status="ok")


@router.get("/readyz", response_model=Health, dependencies=[Depends(bearer_scheme)],
            responses={503: {"description": "Redis or every worker is missing"}})
def readyz(services: ServicesDep) -> Health | JSONResponse:
    """Ready to work: Redis answers and at least one worker's heartbeat is fresh (503 naming what is missing)."""
    try:
        services.redis.ping()
    except Exception as exc:
        return JSONResponse({"detail": f"Redis does not answer: {exc}"}, status_code=503)
    if not services.devices.live():
        return JSONResponse({"detail": "no worker heartbeat is fresh: start `torchyard worker`"}, status_code=503)
    return Health(status="ready")
