"""What POST /jobs/{id}/evaluate takes (`EvaluateSpec`): the dataset to measure a trained job's
checkpoint on, the device, the batch."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from core import defaults
from core.defaults import EVAL_BATCH
from core.schemas import DATASET_DESCRIPTION, DEVICE_DESCRIPTION


class EvaluateSpec(BaseModel):
    """What a user asks for in POST /jobs/{id}/evaluate."""

    model_config = ConfigDict(extra="forbid")

    dataset: str = Field(min_length=1, max_length=200, description=DATASET_DESCRIPTION)
    device: str = Field(default=defaults.DEVICE, max_length=200, description=DEVICE_DESCRIPTION)
    batch_size: int | None = Field(default=None, ge=1, le=8192, description=f"Default: {EVAL_BATCH}.")
