from __future__ import annotations

from fastapi import APIRouter, Request, Response
from starlette.concurrency import run_in_threadpool

from app.api.deps import ServicesDep
from app.api.uploads import stream_upload
from core.datasets import DatasetRecord
from core.errors import InvalidInput

router = APIRouter(tags=["datasets"])

# The body is streamed to disk by app/api/uploads.py (no spooling, the cap enforced as it arrives),
# so its schema is declared here for the OpenAPI document.
_BODY = {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file"],
    "properties": {
        "file": {"type": "string", "format": "binary", "description": "ImageFolder zip (or any zip of images "
                                                                         "with labels=none)"},
        "name": {"type": "string", "minLength": 1, "maxLength": 200},
        "labels": {"type": "string", "enum": ["folders", "none"], "default": "folders",
                   "description": "none: images at any depth, no classes (batch predictions only)"},
    }}}}}


@router.post("/datasets", status_code=201, response_model=DatasetRecord, openapi_extra={"requestBody": _BODY},
             responses={413: {"description": "over a size limit"}, 415: {"description": "not a zip"},
                        422: {"description": "malformed form or unusable archive"}})
async def upload_dataset(services: ServicesDep, request: Request) -> DatasetRecord:
    """Upload an ImageFolder zip (`<class>/<image>`), or with `labels=none` a zip of unlabelled images at
    any depth; unreadable images are skipped and listed."""
    catalog = services.datasets
    upload = await stream_upload(request, catalog.new_upload_path(), max_file_bytes=services.settings.max_upload_bytes)
    try:
        name = upload.fields.get("name") or None
        if name is not None and len(name) > 200:
            raise InvalidInput("name: at most 200 characters")
        labels = upload.fields.get("labels") or "folders"
        if labels not in ("folders", "none"):
            raise InvalidInput(f"labels: {labels!r} is neither 'folders' (ImageFolder) nor 'none' (unlabelled)")
        return await run_in_threadpool(lambda: catalog.upload(upload.path, name, labeled=labels == "folders"))
    finally:
        upload.path.unlink(missing_ok=True)


@router.get("/datasets")
def list_datasets(services: ServicesDep) -> dict[str, list[DatasetRecord]]:
    return {"datasets": services.datasets.list()}


@router.get("/datasets/{dataset_id}", response_model=DatasetRecord)
def get_dataset(services: ServicesDep, dataset_id: str) -> DatasetRecord:
    return services.datasets.get(dataset_id)


@router.delete("/datasets/{dataset_id}", status_code=204)
def delete_dataset(services: ServicesDep, dataset_id: str) -> Response:
    services.datasets.delete(dataset_id)
    return Response(status_code=204)
