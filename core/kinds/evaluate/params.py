"""An evaluate job's params (`EvaluateParams`): whose checkpoint it measures and in what batch,
decided once at submit (`resolve`) and read back by worker/kinds/evaluate.py."""

from __future__ import annotations

from pydantic import ConfigDict, field_validator

from core.defaults import EVAL_BATCH
from core.kinds.evaluate.spec import EvaluateSpec
from core.kinds.params import KindParams
from core.schemas import JobKind


class EvaluateParams(KindParams):
    """An evaluate job's params, as stored with the job."""

    model_config = ConfigDict(frozen=True)
    kind = JobKind.evaluate

    trained_job: str  # whose checkpoint is measured
    batch_size: int = EVAL_BATCH  # images per forward (fewer after an out-of-memory error)

    @field_validator("batch_size", mode="before")
    @classmethod
    def _left_open(cls, value: object) -> object:
        """Records made before the batch was resolved at submit left it null: the default then too."""
        return EVAL_BATCH if value is None else value

    def batch_for(self, device_type: str) -> int:
        """Resolved at submit, the same on every device type."""
        return self.batch_size


def resolve(trained_job: str, spec: EvaluateSpec) -> EvaluateParams:
    return EvaluateParams(trained_job=trained_job, batch_size=spec.batch_size or EVAL_BATCH)
