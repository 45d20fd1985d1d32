"""What POST /jobs accepts: a training job (the default kind) or a batch prediction, told apart by
`kind` (which a training job may leave out; a batch prediction's is "predict" on the wire)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Discriminator, Tag

from core.kinds.batch_predict.spec import BatchPredictSpec
from core.kinds.train.spec import JobSpec
from core.schemas import JobKind


def _spec_kind(value: Any) -> str:
    kind = value.get("kind", JobKind.train) if isinstance(value, dict) else getattr(value, "kind", JobKind.train)
    return str(kind.value if isinstance(kind, JobKind) else kind)


JobRequest = Annotated[Annotated[JobSpec, Tag(JobKind.train.value)]
                       | Annotated[BatchPredictSpec, Tag(JobKind.batch_predict.value)],
                       Discriminator(_spec_kind)]
