"""The one mapping from errors to HTTP responses: always a JSON body with a human-readable `detail`."""

from __future__ import annotations

import logging

import kombu.exceptions
import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from core.errors import TorchyardError, Unavailable

log = logging.getLogger(__name__)


def _describe(errors: list[dict]) -> str:
    parts = []
    for error in errors:
        where = ".".join(str(p) for p in error.get("loc", ()) if p not in ("body", "query", "path", "form"))
        parts.append(f"{where}: {error.get('msg')}" if where else str(error.get("msg")))
    return "; ".join(parts) or "invalid request"


def known_error_response(exc: Exception) -> JSONResponse | None:
    """The response for an error whose meaning we know (ours, Redis's), or None for a bug.

    Shared by the routes' exception handlers and the front gate's direct routes (/predict), which
    run outside FastAPI's routing and so outside its handlers."""
    if isinstance(exc, TorchyardError):
        headers = {"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else None
        if isinstance(exc, Unavailable) and exc.retry_after_s is not None:
            headers = {"Retry-After": str(exc.retry_after_s)}
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=headers)
    if isinstance(exc, StarletteHTTPException):
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)
    # Redis restarting, frozen or gone, seen by redis-py or by Celery's transport (kombu raises its
    # own OperationalError): a 503 the client may retry (with its Idempotency-Key), never a 500.
    if isinstance(exc, redis.RedisError | kombu.exceptions.OperationalError):
        log.warning("Redis unavailable: %s", exc)
        return JSONResponse({"detail": f"Redis is unavailable, retry shortly: {exc}"}, status_code=503,
                            headers={"Retry-After": "2"})
    return None


def unexpected_error_response(exc: Exception, method: str, path: str, *, log_trace: bool) -> JSONResponse:
    """A bug, not bad input: still a JSON `detail` (the contract's shape), the trace in the log
    (Starlette logs it itself for the FastAPI routes: `log_trace` False there)."""
    log.error("unhandled %s on %s %s", type(exc).__name__, method, path, exc_info=exc if log_trace else None)
    return JSONResponse({"detail": f"internal error ({type(exc).__name__}); see the API log"}, status_code=500)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{k: v for k, v in e.items() if k in ("loc", "msg", "type")} for e in exc.errors()]
        return JSONResponse({"detail": _describe(errors), "errors": errors}, status_code=422)

    @app.exception_handler(TorchyardError)
    @app.exception_handler(StarletteHTTPException)
    @app.exception_handler(redis.RedisError)
    @app.exception_handler(kombu.exceptions.OperationalError)
    async def known_error(_: Request, exc: Exception) -> JSONResponse:
        response = known_error_response(exc)
        assert response is not None
        return response

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        return unexpected_error_response(exc, request.method, request.url.path, log_trace=False)
