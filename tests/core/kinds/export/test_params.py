"""An export job's params (core/kinds/export/params.py): what it builds, read back with the parity
figures its worker adds, and the one forward its check runs."""

from __future__ import annotations

from core.defaults import EXPORT_PARITY_IMAGES
from core.kinds.export import ExportParams
from core.schemas import ExportFormat


def test_the_worker_adds_its_parity_figures_and_the_params_still_read_back() -> None:
    stored = {"source_job_id": "t", "format": "onnx", "checkpoint_sha256": "ab" * 32,
              "parity": {"max_abs_probability_difference": 1e-7, "tolerance": 1e-4, "inputs": 36}}
    params = ExportParams.model_validate(stored)
    assert (params.source_job_id, params.format) == ("t", ExportFormat.onnx)
    assert params.model_dump(mode="json") == {"source_job_id": "t", "format": "onnx", "checkpoint_sha256": "ab" * 32}


def test_its_one_forward_is_the_images_its_parity_check_compares() -> None:
    params = ExportParams(source_job_id="t", format=ExportFormat.torchscript, checkpoint_sha256="ab" * 32)
    assert params.batch_for("cuda") == params.batch_for("cpu") == params.eval_batch_for("cpu") == EXPORT_PARITY_IMAGES
