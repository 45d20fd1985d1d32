"""What POST /jobs with `"kind": "predict"` takes (`BatchPredictSpec`): a succeeded training job's
model, by id or alias, over every image of an uploaded dataset. The job kind's wire value stays
"predict" (the HTTP contract); in code it is a batch prediction, so "predict" alone means /predict."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from core import defaults
from core.defaults import PREDICT_BATCH_SIZE, TOP_K, per_device
from core.schemas import DEVICE_DESCRIPTION, JobKind


class BatchPredictSpec(BaseModel):
    """POST /jobs with `"kind": "predict"`: a succeeded training job's model (by id or alias) over every
    image of an uploaded dataset → a JSON-lines results file (GET /jobs/{id}/results)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal[JobKind.batch_predict]
    job_id: str | None = Field(default=None, min_length=1, max_length=128, description="A succeeded training job.")
    alias: str | None = Field(default=None, min_length=1, max_length=128, description="An alias, resolved once at "
                              "submit (the job records the training job it named then).")
    dataset: str = Field(min_length=1, max_length=200, description="An uploaded dataset's id or unique name, "
                                                                    "labelled (ImageFolder) or not.")
    top_k: int = Field(default=TOP_K, ge=1, le=defaults.MAX_TOP_K,
                       description=f"Predictions per image, at most the model's classes. Default: {TOP_K}.")
    batch_size: int | None = Field(default=None, ge=1, le=8192,
                                   description=f"Default: {per_device(PREDICT_BATCH_SIZE)}.")
    device: str = Field(default=defaults.DEVICE, max_length=200, description=DEVICE_DESCRIPTION)

    @model_validator(mode="after")
    def _one_model(self) -> BatchPredictSpec:
        if (self.job_id is None) == (self.alias is None):
            raise ValueError("give exactly one of job_id and alias")
        return self
