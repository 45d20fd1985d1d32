"""A `predict` job (a batch prediction): a trained job's model over every image of an uploaded
dataset, into a JSON-lines results file.

`PredictSpec` is what POST /jobs with `"kind": "predict"` takes, `PredictParams` what the job stores
and worker/kinds/predict.py reads back; `resolve` decides every default it can at submit
(core/batch_predict.py checks the request against the trained job, the alias and the dataset
first). The batch is left to the worker when the job leaves it open: it depends on the device
type (`defaults.PREDICT_BATCH_SIZE`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from core import defaults
from core.datasets import DatasetRecord
from core.defaults import PREDICT_BATCH_SIZE, TOP_K, per_device
from core.schemas import DEVICE_DESCRIPTION, JobKind


class PredictSpec(BaseModel):
    """POST /jobs with `"kind": "predict"`: a succeeded training job's model (by id or alias) over every
    image of an uploaded dataset → a JSON-lines results file (GET /jobs/{id}/results)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal[JobKind.predict]
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
    def _one_model(self) -> PredictSpec:
        if (self.job_id is None) == (self.alias is None):
            raise ValueError("give exactly one of job_id and alias")
        return self


class PredictParams(BaseModel):
    """A predict job's params, as stored with the job."""

    model_config = ConfigDict(frozen=True)

    trained_job: str  # whose model labels the images
    alias: str | None = None  # the alias that named it at submit, if one did
    top_k: int = TOP_K
    batch_size: int | None = None  # None: the device type's (PREDICT_BATCH_SIZE), decided on the worker
    labeled: bool = True  # the dataset's class folders give each line its true `label`
    images: int | None = None  # the dataset's, at submit

    def batch_for(self, device_type: str) -> int:
        return self.batch_size or PREDICT_BATCH_SIZE[device_type]


def resolve(trained_job: str, spec: PredictSpec, dataset: DatasetRecord) -> PredictParams:
    return PredictParams(trained_job=trained_job, alias=spec.alias, top_k=spec.top_k, batch_size=spec.batch_size,
                         labeled=dataset.labeled, images=dataset.num_images)
