"""The Open Inference Protocol's REST endpoints under /v2, served by the front gate itself.

A plain ASGI app past FastAPI's routing, as /predict is (app/api/serving/direct.py): the gate has
checked Host, key, size on the headers (the infer routes take /predict's body cap and any content
type: tritonclient sends none), and every answer, an error included, is in the protocol's shape:
`{"error": "..."}` with 400 (a wrong shape, datatype, name, a malformed body or binary header),
404 (no such model or version: an unknown name, or a job that is not a training job), 409 (the job
has not succeeded), 413, 415, 503 (as /predict). Never a 500: a bug answers 500 in that shape and
is logged with its trace.

    GET  /v2                                         server metadata (the extensions served)
    GET  /v2/health/live | /v2/health/ready          (open: no key, as /healthz)
    GET  /v2/models/{name}[/versions/{v}]            model metadata
    GET  …/ready                                     200 ready, 400 not
    GET  …/config                                    Triton's model configuration (perf_analyzer reads it)
    GET  …/stats                                     Triton's statistics (app/api/oip/stats.py)
    POST …/infer                                     app/api/oip/infer.py
    POST /v2/repository/index                        the models: aliases, succeeded training jobs
"""

from __future__ import annotations

import logging

import orjson
import redis
from starlette.requests import ClientDisconnect, Request
from starlette.types import Receive, Scope, Send

from app.api.front import BodyTimeout, BodyTooLarge, DirectRoute
from app.api.oip.service import PREFIX
from core.errors import TorchyardError, Unavailable

log = logging.getLogger(__name__)


async def serve(scope: Scope, receive: Receive, send: Send) -> None:
    request = Request(scope, receive)
    headers: list[tuple[bytes, bytes]] = []
    try:
        status, body, headers = await request.app.state.services.oip.respond(request)
    except TorchyardError as exc:
        status, body = (400 if exc.status_code == 422 else exc.status_code), _error(exc.detail)
        if isinstance(exc, Unavailable) and exc.retry_after_s is not None:
            headers = [(b"retry-after", str(exc.retry_after_s).encode())]
    except redis.RedisError as exc:
        status, body, headers = 503, _error(f"Redis is unavailable, retry shortly: {exc}"), [(b"retry-after", b"2")]
    except (BodyTooLarge, BodyTimeout):
        raise  # the gate answers these itself, in this route's error shape
    except ClientDisconnect:
        return  # nobody to answer
    except Exception as exc:
        log.error("unhandled %s on %s %s", type(exc).__name__, scope["method"], scope["path"], exc_info=exc)
        status, body = 500, _error(f"internal error ({type(exc).__name__}); see the API log")
    if body and not any(name == b"content-type" for name, _ in headers):
        headers = [*headers, (b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _error(detail: str) -> bytes:
    return orjson.dumps({"error": detail})


ROUTE = DirectRoute(PREFIX, serve, error_key="error")
