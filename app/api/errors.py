"""The one mapping from errors to HTTP responses: always a JSON body with a human-readable `detail`.

A request that fails validation is described in the user's words: the fields they sent, never
pydantic's wrappers (`train.epochs`, the tag function of POST /jobs' union of kinds)."""

from __future__ import annotations

import difflib
import logging
from collections.abc import Sequence
from typing import Any

import kombu.exceptions
import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from core.errors import OverQuota, TorchyardError, Unavailable
from core.schemas import JobKind

log = logging.getLogger(__name__)


# Where pydantic says a value was: the request part, then (for POST /jobs' union of job kinds)
# the tag of the kind it was checked as. Neither is a field the user wrote.
_REQUEST_PARTS = frozenset({"body", "query", "path", "form", "header", "cookie"})
_KIND_TAGS = frozenset(kind.value for kind in JobKind)


def user_location(loc: Sequence[str | int]) -> list[str | int]:
    """The field as the user wrote it: `["body", "train", "epochs"]` → `["epochs"]`."""
    where = list(loc)
    if where and where[0] in _REQUEST_PARTS:
        where = where[1:]
    if loc and loc[0] == "body" and where and where[0] in _KIND_TAGS:
        where = where[1:]
    return where


def user_message(error: dict[str, Any]) -> str:
    """One validation error in the user's words: their field's name, and what to send instead."""
    kind, msg, ctx = error.get("type"), str(error.get("msg", "")), error.get("ctx") or {}
    where = user_location(error.get("loc", ()))
    field = ".".join(str(part) for part in where)
    if kind == "union_tag_invalid":
        return (f"kind {ctx.get('tag')!r} is not a kind of job POST /jobs creates: send \"train\" (the default) or "
                f"\"predict\"; an evaluation is POST /jobs/{{id}}/evaluate, an export GET /jobs/{{id}}/export")
    if kind == "extra_forbidden":
        near = nearest_field(error.get("loc", ()), str(where[-1]) if where else field)
        hint = f"; did you mean {near!r}?" if near else ""
        return (f"unknown field {field!r}: not part of this request{hint} (the fields are in docs/api.md and at "
                f"/docs)")
    if kind == "missing":
        return f"{field} is required"
    if kind == "json_invalid":
        return f"the body is not valid JSON ({ctx.get('error', msg)})"
    if kind in ("model_attributes_type", "dict_type", "model_type") and not field:
        return "the body must be a JSON object"
    if kind == "value_error":
        msg = msg.removeprefix("Value error, ")
    return f"{field}: {msg}" if field else msg


# Short names people bring from other tools, and the field each means here.
_FIELD_ABBREVIATIONS = {"lr": "learning_rate", "bs": "batch_size", "wd": "weight_decay", "opt": "optimizer",
                        "model_name": "model", "data": "dataset", "job": "job_id", "topk": "top_k", "k": "top_k"}


def nearest_field(loc: Sequence[str | int], name: str) -> str | None:
    """The field of the request's kind (a training job, a batch prediction, an evaluation) that an
    unknown `name` most likely meant: a known abbreviation (`lr`) or a close spelling (`epoch`)."""
    from core.kinds.batch_predict.spec import BatchPredictSpec
    from core.kinds.evaluate.spec import EvaluateSpec
    from core.kinds.train.spec import JobSpec

    by_tag: dict[str | int, type[BaseModel]] = {JobKind.train.value: JobSpec,
                                                JobKind.batch_predict.value: BatchPredictSpec}
    tag = loc[1] if len(loc) > 2 and loc[0] == "body" else None
    specs: list[type[BaseModel]] = [by_tag[tag]] if tag is not None and tag in by_tag else [JobSpec, BatchPredictSpec, EvaluateSpec]
    fields = sorted({f for spec in specs for f in spec.model_fields})
    meant = _FIELD_ABBREVIATIONS.get(name.lower())
    if meant in fields:
        return meant
    close = difflib.get_close_matches(name.lower().replace("-", "_"), fields, n=1, cutoff=0.7)
    return close[0] if close else None


def _describe(errors: list[dict[str, Any]]) -> str:
    return "; ".join(user_message(error) for error in errors) or "invalid request"


def known_error_response(exc: Exception) -> JSONResponse | None:
    """The response for an error whose meaning we know (ours, Redis's), or None for a bug.

    Shared by the routes' exception handlers and the front gate's direct routes (/predict), which
    run outside FastAPI's routing and so outside its handlers."""
    if isinstance(exc, TorchyardError):
        headers = {"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else None
        if isinstance(exc, Unavailable | OverQuota) and exc.retry_after_s is not None:
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
        found = list(exc.errors())
        errors = [{"loc": [*e.get("loc", ())[:1], *user_location(e.get("loc", ()))], "msg": user_message(e),
                   "type": e.get("type")} for e in found]
        return JSONResponse({"detail": _describe(found), "errors": errors}, status_code=422)

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
