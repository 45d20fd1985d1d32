"""POST /predict: served by the front gate directly (`DIRECT`), declared here for OpenAPI too."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from starlette.types import Receive, Scope, Send

from app.api.deps import ServicesDep
from app.api.errors import known_error_response, unexpected_error_response
from app.api.front import DirectRoute
from core.defaults import MAX_TOP_K, TOP_K
from core.images import IMAGE_FORMATS_TEXT
from core.schemas import PredictResponse

router = APIRouter(tags=["predict"])

# The body is read as it streams by app/api/multipart.py (see there why not FastAPI's form parsing),
# so its schema is declared here for the OpenAPI document.
_BODY = {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file"],
    "properties": {
        "file": {"type": "array", "items": {"type": "string", "format": "binary"},
                 "description": f"One or more images: {IMAGE_FORMATS_TEXT} (a GIF's first frame)."},
        "job_id": {"type": "string", "minLength": 1, "maxLength": 200,
                   "description": "A succeeded job (exactly one of job_id and alias)."},
        "alias": {"type": "string", "minLength": 1, "maxLength": 64,
                  "description": "An alias (PUT /aliases/{name}) instead of job_id; the response names both."},
        "top_k": {"type": "integer", "minimum": 1, "maximum": MAX_TOP_K, "default": TOP_K,
                  "description": f"Predictions per image, at most the model's classes. Default: {TOP_K}."},
    }}}}}


@router.post("/predict", response_model=PredictResponse, openapi_extra={"requestBody": _BODY},
             responses={404: {"description": "no such job or alias"}, 409: {"description": "job not succeeded"},
                        413: {"description": "too large (bytes, pixels or images per request)"},
                        415: {"description": "not an image"}, 422: {"description": "malformed form"},
                        503: {"description": "no live worker answered, or the API holds too many images in "
                                             "flight (with Retry-After)"}})
async def predict(services: ServicesDep, request: Request) -> Response:
    """Classify one or more images (`file` parts) with a succeeded job's model (`job_id`, or an `alias`
    that names one), on a live worker."""
    return Response(await services.predictions.answer(request), media_type="application/json")


async def _serve(scope: Scope, receive: Receive, send: Send) -> None:
    """The route as a plain ASGI app, for the front gate: the same answer and the same errors as the
    FastAPI route above, without FastAPI's routing and dependency layers; an answer is sent as the
    two ASGI messages themselves."""
    request = Request(scope, receive)
    try:
        body = await request.app.state.services.predictions.answer(request)
    except Exception as exc:
        response = known_error_response(exc) or unexpected_error_response(exc, "POST", "/predict", log_trace=True)
        await response(scope, receive, send)
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


DIRECT = {("POST", "/predict"): DirectRoute("/predict", _serve)}
