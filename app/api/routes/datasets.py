from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, Form, Response, UploadFile

from app.api.deps import ServicesDep
from app.core.datasets import DatasetRecord
from app.core.errors import TooLarge

router = APIRouter(tags=["datasets"])


@router.post("/datasets", status_code=201, response_model=DatasetRecord)
def upload_dataset(services: ServicesDep, file: Annotated[UploadFile, File(description="ImageFolder zip")],
                   name: Annotated[str | None, Form(max_length=200)] = None) -> DatasetRecord:
    if file.size is not None and file.size > services.settings.max_upload_bytes:
        raise TooLarge(f"upload is {file.size} bytes; the limit is {services.settings.max_upload_bytes}")
    return services.datasets.upload(file.file, name)


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
