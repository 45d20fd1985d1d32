"""GET /jobs/{id}/export: a trained job's model as TorchScript or ONNX, built on a worker (core/kinds/export/)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import FileResponse, JSONResponse

from app.api.deps import ServicesDep
from core.kinds.export.submit import MEDIA_TYPES, download_name
from core.schemas import ExportFormat, Job

router = APIRouter(tags=["exports"])


@router.get("/jobs/{job_id}/export", response_class=FileResponse, response_model=None,
            responses={200: {"content": {"application/octet-stream": {}},
                             "description": "The exported model; X-Export-SHA256 is its sha256"},
                       202: {"model": Job, "description": "Building: poll Location (the export job) or GET again "
                                                          "after Retry-After seconds"},
                       404: {"description": "no such job"}, 409: {"description": "not a succeeded training job"},
                       422: {"description": "bad format, or the export failed (e.g. parity); retry=true rebuilds"},
                       429: {"description": "building it needs a job, and the project's queued_jobs quota is "
                                            "reached (Retry-After)"},
                       501: {"description": "the worker that built it lacks the `export` extra"}})
def export_model(services: ServicesDep, job_id: str,
                 fmt: Annotated[ExportFormat, Query(alias="format", description="torchscript or onnx")],
                 retry: Annotated[bool, Query(description="Build again after a failed export.")] = False,
                 ) -> FileResponse | JSONResponse:
    """The network plus its normalisation: float32 N×C×H×W in [0, 1] at the trained size → logits, with the
    class names and the input spec inside the file. Built once per checkpoint sha256 and format on a worker,
    and checked against the checkpoint (probabilities within 1e-4) before it is served."""
    source, export, path = services.exports.request(job_id, fmt, retry=retry)
    if path is None:
        return JSONResponse(export.model_dump(mode="json"), status_code=202,
                            headers={"Location": f"/jobs/{export.id}",
                                     "Retry-After": str(services.settings.export_retry_after_s)})
    assert export.checkpoint is not None and source.checkpoint is not None
    return FileResponse(path, media_type=MEDIA_TYPES[fmt], filename=download_name(source, fmt),
                        headers={"X-Export-SHA256": export.checkpoint.sha256, "X-Export-Job": export.id,
                                 "X-Checkpoint-SHA256": source.checkpoint.sha256})
