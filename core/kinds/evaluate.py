"""An `evaluate` job: a trained job's checkpoint measured on a labelled dataset.

`EvaluateSpec` is what POST /jobs/{id}/evaluate takes, `EvaluateParams` what the job stores and
worker/kinds/evaluate.py reads back; `resolve` decides every default once, at submit
(core/evaluations.py checks the request against the trained job and the dataset first).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from core import defaults
from core.defaults import EVAL_BATCH
from core.schemas import DATASET_DESCRIPTION, DEVICE_DESCRIPTION


class EvaluateSpec(BaseModel):
    """What a user asks for in POST /jobs/{id}/evaluate."""

    model_config = ConfigDict(extra="forbid")

    dataset: str = Field(min_length=1, max_length=200, description=DATASET_DESCRIPTION)
    device: str = Field(default=defaults.DEVICE, max_length=200, description=DEVICE_DESCRIPTION)
    batch_size: int | None = Field(default=None, ge=1, le=8192, description=f"Default: {EVAL_BATCH}.")


class EvaluateParams(BaseModel):
    """An evaluate job's params, as stored with the job."""

    model_config = ConfigDict(frozen=True)

    trained_job: str  # whose checkpoint is measured
    batch_size: int = EVAL_BATCH  # images per forward (fewer after an out-of-memory error)

    @field_validator("batch_size", mode="before")
    @classmethod
    def _left_open(cls, value: object) -> object:
        """Records made before the batch was resolved at submit left it null: the default then too."""
        return EVAL_BATCH if value is None else value


def resolve(trained_job: str, spec: EvaluateSpec) -> EvaluateParams:
    return EvaluateParams(trained_job=trained_job, batch_size=spec.batch_size or EVAL_BATCH)
