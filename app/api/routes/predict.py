"""POST /predict: served by the front gate directly (`DIRECT`), declared here for OpenAPI too."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from starlette.types import Receive, Scope, Send

from app.api.deps import ServicesDep
from app.api.errors import known_error_response, unexpected_error_response
from app.api.front import DirectRoute
from app.api.multipart import read_form
from app.api.predictions import UploadedImage
from app.api.services import Services
from core.errors import InvalidInput, TooLarge
from core.schemas import PredictResponse

router = APIRouter(tags=["predict"])

# The body is read by app/api/multipart.py (FastAPI's form parsing was a third of the API's CPU
# per prediction), so its schema is declared here for the OpenAPI document.
_BODY = {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file"],
    "properties": {
        "file": {"type": "array", "items": {"type": "string", "format": "binary"},
                 "description": "One or more images: PNG, JPEG, WebP, BMP, GIF (first frame)."},
        "job_id": {"type": "string", "minLength": 1, "maxLength": 200,
                   "description": "A succeeded job (exactly one of job_id and alias)."},
        "alias": {"type": "string", "minLength": 1, "maxLength": 64,
                  "description": "An alias (PUT /aliases/{name}) instead of job_id; the response names both."},
        "top_k": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 5},
    }}}}}


@router.post("/predict", response_model=PredictResponse, openapi_extra={"requestBody": _BODY},
             responses={404: {"description": "no such job or alias"}, 409: {"description": "job not succeeded"},
                        413: {"description": "too large (bytes, pixels or images per request)"},
                        415: {"description": "not an image"}, 422: {"description": "malformed form"},
                        503: {"description": "no live worker answered"}})
async def predict(services: ServicesDep, request: Request) -> Response:
    """Classify one or more images (`file` parts) with a succeeded job's model (`job_id`, or an `alias`
    that names one), on a live worker."""
    return Response(await _answer(services, request), media_type="application/json")


async def _answer(services: Services, request: Request) -> bytes:
    settings = services.settings
    form = await read_form(request, max_parts=settings.max_images_per_request + 8, file_fields=frozenset({"file"}))
    job_id, alias = form.fields.get("job_id") or None, form.fields.get("alias") or None
    if (job_id is None) == (alias is None):
        raise InvalidInput("send exactly one of the form fields job_id and alias")
    if job_id is not None and len(job_id) > 200:
        raise InvalidInput("job_id: a form field of 1 to 200 characters is required")
    try:
        top_k = int(form.fields.get("top_k", "5"))
    except ValueError:
        raise InvalidInput("top_k: must be an integer between 1 and 1000") from None
    images = []
    for filename, data in form.files.get("file", []):
        if len(data) > settings.max_image_bytes:
            raise TooLarge(f"{filename or 'image'} is over the limit of {settings.max_image_bytes} bytes")
        images.append(UploadedImage(filename, data))
    if not images:
        raise InvalidInput("file: send at least one image as a `file` part")
    # The worker's JSON is already a PredictResponse: pass it through rather than validate and re-encode it.
    return await services.predictions.predict(job_id, images, top_k, alias=alias)


async def _serve(scope: Scope, receive: Receive, send: Send) -> None:
    """The route as a plain ASGI app, for the front gate: the same answer and the same errors as the
    FastAPI route above, without FastAPI's routing and dependency layers; an answer is sent as the
    two ASGI messages themselves."""
    request = Request(scope, receive)
    try:
        body = await _answer(request.app.state.services, request)
    except Exception as exc:
        response = known_error_response(exc) or unexpected_error_response(exc, "POST", "/predict", log_trace=True)
        await response(scope, receive, send)
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


DIRECT = {("POST", "/predict"): DirectRoute("/predict", _serve)}
