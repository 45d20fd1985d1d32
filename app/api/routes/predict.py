from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, UploadFile

from app.api.deps import ServicesDep
from app.core.errors import TooLarge
from app.core.predictions import UploadedImage
from app.core.schemas import PredictResponse

router = APIRouter(tags=["predict"])


@router.post("/predict", response_model=PredictResponse,
             responses={409: {"description": "job not succeeded"}, 413: {"description": "too large"},
                        415: {"description": "not an image"}, 503: {"description": "no live worker"}})
async def predict(services: ServicesDep, file: list[UploadFile], job_id: Annotated[str, Form(max_length=200)],
                  top_k: Annotated[int, Form(ge=1, le=1000)] = 5) -> PredictResponse:
    limit = services.settings.max_image_bytes
    images = []
    for upload in file:
        data = await upload.read(limit + 1)
        if len(data) > limit:
            raise TooLarge(f"{upload.filename or 'image'} is over the limit of {limit} bytes")
        images.append(UploadedImage(upload.filename, data))
    return await services.predictions.predict(job_id, images, top_k)
