"""An `export` job: a trained job's model as a file that runs without torchyard (TorchScript, ONNX).

It is created by GET /jobs/{id}/export (core/exports.py), never by a request of its own, with
`ExportParams`; worker/kinds/export.py reads them back and, once the file passed its parity check,
adds the check's figures (`parity`) to them.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from core.schemas import ExportFormat


class ExportParams(BaseModel):
    """What an export job builds, stored as its `params`."""

    model_config = ConfigDict(extra="ignore")  # the worker adds `parity` once the file is checked

    source_job_id: str
    format: ExportFormat
    checkpoint_sha256: str
