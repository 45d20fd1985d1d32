"""POST /predict, declared for OpenAPI: the front gate serves it itself (app/api/serving/direct.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from app.api.deps import ServicesDep
from core.defaults import MAX_TOP_K, TOP_K
from core.images import IMAGE_FORMATS_TEXT
from core.schemas import PredictResponse

router = APIRouter(tags=["predict"])

# The body is read as it streams by app/api/serving/multipart.py (see there why not FastAPI's form parsing),
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
                        429: {"description": "the project's predict_per_second quota (Retry-After)"},
                        503: {"description": "no live worker answered, or the API holds too many images in "
                                             "flight (with Retry-After)"}})
async def predict(services: ServicesDep, request: Request) -> Response:
    """Classify one or more images (`file` parts) with a succeeded job's model (`job_id`, or an `alias`
    that names one), on a live worker."""
    return Response(await services.predictions.answer(request), media_type="application/json")

