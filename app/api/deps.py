"""Annotated dependencies: routes declare what they need, the app injects it."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPBearer

from app.api.services import Services

# The API key is checked by the front gate (app/api/front.py) on the headers, before a body is
# read: FastAPI runs dependencies only after it has read and parsed the body. This scheme only
# documents the key in the OpenAPI document (it never refuses anything itself).
bearer_scheme = HTTPBearer(auto_error=False, description="TORCHYARD_API_KEY, when the server sets one")


# `async def` though it never awaits: FastAPI runs a plain `def` dependency in its thread pool, a
# thread hop per request, a sizeable share of what /predict costs the API in CPU.
async def get_services(request: Request) -> Services:
    return request.app.state.services


ServicesDep = Annotated[Services, Depends(get_services)]
