"""A batch prediction's params (`BatchPredictParams`): whose model labels the images, how many
answers per image, in what batch; decided at submit (`resolve`) as far as they can be, read back
by worker/kinds/batch_predict.py. The batch is left to the worker when the job leaves it open: it
depends on the device type (`defaults.PREDICT_BATCH_SIZE`), and `batch_for` says which."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import ConfigDict

from core.defaults import PREDICT_BATCH_SIZE, TOP_K
from core.kinds.batch_predict.spec import BatchPredictSpec
from core.kinds.params import KindParams
from core.schemas import JobKind

if TYPE_CHECKING:  # the record type only: core/datasets.py is the API's, with Redis and the job store
    from core.datasets import DatasetRecord


class BatchPredictParams(KindParams):
    """A batch prediction's params, as stored with the job."""

    model_config = ConfigDict(frozen=True)
    kind = JobKind.batch_predict

    trained_job: str  # whose model labels the images
    alias: str | None = None  # the alias that named it at submit, if one did
    top_k: int = TOP_K
    batch_size: int | None = None  # None: the device type's (`batch_for`), chosen on the worker
    labeled: bool = True  # the dataset's class folders give each line its true `label`
    images: int | None = None  # the dataset's, at submit

    def batch_for(self, device_type: str) -> int:
        """The job's batch, else the device type's default: every forward is an evaluation's."""
        return self.batch_size or PREDICT_BATCH_SIZE[device_type]


def resolve(trained_job: str, spec: BatchPredictSpec, dataset: DatasetRecord) -> BatchPredictParams:
    return BatchPredictParams(trained_job=trained_job, alias=spec.alias, top_k=spec.top_k, batch_size=spec.batch_size,
                              labeled=dataset.labeled, images=dataset.num_images)
