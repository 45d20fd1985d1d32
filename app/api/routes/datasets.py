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
        "new_version": {"type": "boolean", "default": False,
                        "description": "true: a new version of the dataset that has `name` (the name then means "
                                       "this one; the older keeps its id). Without it a taken name is a 409"},
    }}}}}


@router.post("/datasets", status_code=201, response_model=DatasetRecord, openapi_extra={"requestBody": _BODY},
             responses={413: {"description": "over a size limit"}, 415: {"description": "not a zip"},
                        409: {"description": "the name is taken (the detail names the dataset that has it)"},
                        422: {"description": "malformed form or unusable archive"},
                        429: {"description": "the project's dataset_bytes quota would be passed"}})
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
        new_version = (upload.fields.get("new_version") or "false").lower()
        if new_version not in ("true", "false", "1", "0"):
            raise InvalidInput(f"new_version: {new_version!r} is neither true nor false")
        return await run_in_threadpool(lambda: catalog.upload(upload.path, name, labeled=labels == "folders",
                                                              new_version=new_version in ("true", "1")))
    finally:
        upload.path.unlink(missing_ok=True)


@router.get("/datasets")
def list_datasets(services: ServicesDep) -> dict[str, list[DatasetRecord]]:
    """The built-in datasets, then the uploads (each version of a name is its own entry)."""
    return {"datasets": services.datasets.list()}


@router.get("/datasets/{dataset}", response_model=DatasetRecord,
            responses={404: {"description": "no dataset has this id or name"}})
def get_dataset(services: ServicesDep, dataset: str) -> DatasetRecord:
    """One dataset, by id or by name (a name means its newest version), as POST /jobs takes them."""
    return services.datasets.find(dataset)


@router.delete("/datasets/{dataset}", status_code=204,
               responses={404: {"description": "no dataset has this id or name"},
                          409: {"description": "built in, or a queued or running job uses it"}})
def delete_dataset(services: ServicesDep, dataset: str) -> Response:
    """Delete an uploaded dataset, by id or by name (its newest version), files included."""
    services.datasets.delete(dataset)
    return Response(status_code=204)
