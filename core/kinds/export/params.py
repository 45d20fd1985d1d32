"""An export job's params (`ExportParams`): which checkpoint (job and sha256) it builds a file of,
and in what format. It is created by GET /jobs/{id}/export (core/kinds/export/submit.py), never by a
request of its own; worker/kinds/export.py reads them back and, once the file passed its parity
check, adds the check's figures (`parity`) to them."""

from __future__ import annotations

from pydantic import ConfigDict

from core.defaults import EXPORT_PARITY_IMAGES
from core.kinds.params import KindParams
from core.schemas import ExportFormat, JobKind


class ExportParams(KindParams):
    """What an export job builds, stored as its `params`."""

    model_config = ConfigDict(extra="ignore")  # the worker adds `parity` once the file is checked
    kind = JobKind.export

    source_job_id: str
    format: ExportFormat
    checkpoint_sha256: str

    def batch_for(self, device_type: str) -> int:
        """Its one forward: the images its parity check compares (the export itself runs on the CPU)."""
        return EXPORT_PARITY_IMAGES
