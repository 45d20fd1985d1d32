"""Annotated dependencies: routes declare what they need, the app injects it."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from app.api.services import Services
from app.core.errors import Unauthorized

_bearer = HTTPBearer(auto_error=False, description="TORCHYARD_API_KEY, when the server sets one")


# Both dependencies are `async def` though they never await: FastAPI runs a plain `def` dependency
# in its thread pool, a thread hop per request that cost ~15% of the API's CPU on /predict.
async def get_services(request: Request) -> Services:
    return request.app.state.services


ServicesDep = Annotated[Services, Depends(get_services)]


async def require_api_key(services: ServicesDep,
                          credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
    """Constant-time check of the bearer token; a no-op when no key is configured."""
    expected = services.settings.api_key
    if expected is None:
        return
    given = credentials.credentials if credentials else ""
    if not hmac.compare_digest(given.encode(), expected.get_secret_value().encode()):
        raise Unauthorized("missing or wrong API key: send `Authorization: Bearer <TORCHYARD_API_KEY>`")
